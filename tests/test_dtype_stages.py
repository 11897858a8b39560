"""`dtype: auto` per stage (draftkit/device.py): batched stages follow the CPU flags, the one-token
decode stage follows a short measurement on a CPU without native bf16, a forced dtype is every
stage's, and a target cast for decoding is the target loaded in that dtype.

CPU flags are monkeypatched (torch.cpu's probes and draftkit.target.cpu_flags) and the plain
decoding the measurement times replaced by a fake that charges a clock by the dtype the target is
in when run, so every choice is deterministic on any machine.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftkit import device
from draftkit.device import DECODE_MARGIN, DECODE_REPEATS, stage_dtypes, use_decode_dtype
from draftkit.inference import timing
from tests.conftest import make_tiny_target

FIXTURES = Path(__file__).parent / "fixtures"
AVX2 = "avx2; torch cpu capability AVX2"

pytestmark = pytest.mark.usefixtures("one_thread")


def cpu(monkeypatch, amx: bool = False, avx512_bf16: bool = False, flags: str = AVX2) -> None:
    """Make this CPU look like one with (or without) AMX / AVX512-BF16, reporting `flags`."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr("draftkit.target.cpu_flags", lambda: flags)


def fake_timings(monkeypatch, ms: dict[str, list[float]], loop: dict[str, tuple[float, float]] | None = None
                 ) -> list[str]:
    """Plain decoding, as the measurement times it (draftkit/inference/timing.py), costs
    ms[dtype of the target's weights now][round] per generated token on a clock of timing's own,
    and the loop's prefill and verify forward (timing.loop_forward) cost loop[dtype] = (ms of the
    prefill, ms of the verify forward) (default: bfloat16 0.9x float32's 100 / 50 ms, so the step
    decides); returns the dtypes seen, one per round (its longer plain run), in order."""
    seen: list[str] = []
    clock = SimpleNamespace(now=0.0)
    loop = loop or {"float32": (100.0, 50.0), "bfloat16": (80.0, 40.0)}

    def dtype_now(target) -> str:
        name = str(target.dtype).replace("torch.", "")
        assert {t.dtype for t in target.dtype_tensors()} == {target.dtype}  # the whole target, not only lm_head
        return name

    def plain(target, prompts, n, *a, **kw):
        name = dtype_now(target)
        rnd = seen.count(name)  # a round's 1-token run comes before its longer one
        seen.extend([name] * (n > 1))
        clock.now += n * ms[name][rnd] / 1e3

    def forward(target, context, width):
        assert len(context) == device.PREFILL_CONTEXT and width in (0, device.VERIFY_WIDTH)
        prefill, verify = loop[dtype_now(target)]
        clock.now += (prefill + (verify if width else 0.0)) / 1e3

    monkeypatch.setattr(timing, "plain_generate", plain)
    monkeypatch.setattr(timing, "loop_forward", forward)
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    return seen


def test_auto_on_an_avx2_cpu_decodes_in_bf16_only_when_measured_faster(monkeypatch, caplog):
    """AVX2 only: batched float32 always; decode bfloat16 iff the min-over-rounds bf16 step beats
    fp32's by the margin (an outlier round moves nothing); rounds interleave the dtypes; the
    target's own float32 tensors are back afterwards; the printed line names the flags, each
    stage's dtype and the measurement, and the target is cast for decoding, saying so."""
    cpu(monkeypatch)
    target = make_tiny_target()
    own = [t.data_ptr() for t in target.dtype_tensors()]
    seen = fake_timings(monkeypatch, {"float32": [90.0, 74.0, 80.0], "bfloat16": [500.0, 45.0, 50.0]})
    st = stage_dtypes("auto", target)
    assert (st.batched, st.decode) == ("float32", "bfloat16")
    assert st.decode_ms == pytest.approx({"float32": 74.0, "bfloat16": 45.0}, rel=1e-9)
    assert seen == ["float32", "bfloat16"] * DECODE_REPEATS
    assert target.dtype == torch.float32 and [t.data_ptr() for t in target.dtype_tensors()] == own
    for bf16, want in ((120.0, "float32"), (100 * (1 - DECODE_MARGIN) + 1, "float32"),
                       (100 * (1 - DECODE_MARGIN) - 1, "bfloat16")):
        fake_timings(monkeypatch, {"float32": [100.0] * 3, "bfloat16": [bf16] * 3})
        st = stage_dtypes("auto", target)
        assert (st.batched, st.decode) == ("float32", want), bf16
    fake_timings(monkeypatch, {"float32": [74.0] * 3, "bfloat16": [45.0] * 3})
    with caplog.at_level("INFO", logger="draftkit.device"):
        st = use_decode_dtype("auto", target)
    line = st.describe()
    assert line.startswith("dtype auto: batched stages float32, decode bfloat16 (") and line in caplog.messages
    assert f"cpu flags: {AVX2}" in line and "float32 74.0 ms, bfloat16 45.0 ms" in line
    assert "target cast float32 -> bfloat16 for the decode stage" in caplog.text
    assert target.dtype == torch.bfloat16 and target.dtype_choice == line
    assert st.to_dict()["line"] == line and st.to_dict()["margin"] == DECODE_MARGIN


def test_auto_decodes_in_bf16_only_when_the_verify_and_the_prefill_are_faster_too(monkeypatch):
    """The loop also prefills every prompt and verifies several tokens per forward, which are compute-
    bound: on an AVX2-only CPU bf16 took 0.43-0.56x fp32's one-token step but 1.1-1.3x its 8-token
    verify and 3-6x its prefill (benchmarks/results/decode_dtype_avx2.json). A bf16 step faster by
    far decides nothing when either of the other two is not faster by the margin; all three faster
    gives bf16. The line and to_dict carry the three measurements."""
    cpu(monkeypatch)
    target = make_tiny_target()
    step = {"float32": [90.0] * 3, "bfloat16": [50.0] * 3}
    edge = 100 * (1 - DECODE_MARGIN)
    for loop, want in (({"float32": (375.0, 139.0), "bfloat16": (2180.0, 154.0)}, "float32"),  # measured
                       ({"float32": (100.0, 100.0), "bfloat16": (50.0, edge + 1)}, "float32"),  # verify not faster
                       ({"float32": (100.0, 100.0), "bfloat16": (edge + 1, 50.0)}, "float32"),  # prefill not faster
                       ({"float32": (100.0, 100.0), "bfloat16": (edge - 1, edge - 1)}, "bfloat16")):
        fake_timings(monkeypatch, step, loop)
        st = stage_dtypes("auto", target)
        assert (st.batched, st.decode) == ("float32", want), loop
        assert st.prefill_ms == pytest.approx({k: v[0] for k, v in loop.items()}, rel=1e-9)
        assert st.verify_ms == pytest.approx({k: v[1] for k, v in loop.items()}, rel=1e-9)
        assert st.decode_ms == pytest.approx({"float32": 90.0, "bfloat16": 50.0}, rel=1e-9)
    line = st.describe()
    assert f"{device.VERIFY_WIDTH}-token verify float32 100.0 ms, bfloat16 {edge - 1:.1f} ms" in line
    assert f"{device.PREFILL_CONTEXT}-token prefill float32 100.0 ms" in line and "at all three" in line
    assert st.to_dict()["verify_ms"] == st.verify_ms and st.to_dict()["prefill_ms"] == st.prefill_ms


def test_native_bf16_and_forced_dtypes_measure_nothing(monkeypatch, caplog):
    """AVX512-BF16 or AMX: bf16 for both stages, unmeasured, the target left as loaded; a forced
    dtype is every stage's on any CPU (an AVX2-only one included) and never cast."""
    def no_measuring(*a, **kw):
        raise AssertionError("measured a decode step where the rule needs none")

    monkeypatch.setattr(timing, "plain_generate", no_measuring)
    for amx, avx512_bf16 in ((False, True), (True, False)):
        cpu(monkeypatch, amx, avx512_bf16, flags="avx2 avx512f avx512_bf16; torch cpu capability AVX512")
        target = make_tiny_target(dtype=torch.bfloat16)
        own = [t.data_ptr() for t in target.dtype_tensors()]
        st = use_decode_dtype("auto", target)
        assert (st.batched, st.decode, st.decode_ms) == ("bfloat16", "bfloat16", None)
        assert "not measured: bf16 is native here" in st.describe() and "avx512_bf16" in st.describe()
        assert [t.data_ptr() for t in target.dtype_tensors()] == own and target.dtype_choice is None
    cpu(monkeypatch)  # AVX2 only: auto would measure, a forced dtype does not
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        target = make_tiny_target(dtype=dt)
        own = [t.data_ptr() for t in target.dtype_tensors()]
        st = use_decode_dtype(name, target)
        assert (st.batched, st.decode, st.basis) == (name, name, "forced")
        assert st.describe() == f"dtype {name} (forced) for every stage"
        assert target.dtype == dt and [t.data_ptr() for t in target.dtype_tensors()] == own


def test_a_cast_target_is_the_target_loaded_in_that_dtype(tmp_path):
    """Target.cast("bfloat16") of a float32 load equals load_target(dtype="bfloat16"): every
    parameter and buffer (rotary inv_freq stays float32, as transformers loads it), config.dtype,
    the logits and the greedy tokens. The real measurement times both dtypes and puts the float32
    tensors back bit for bit."""
    from draftkit.inference.decoder import plain_generate
    from draftkit.target import load_target
    from tests.test_evaluate import chat_target

    src = chat_target()
    src.model.save_pretrained(tmp_path)
    src.tokenizer.save_pretrained(tmp_path)
    loaded = load_target(str(tmp_path), dtype="float32")
    before = [t.clone() for t in loaded.dtype_tensors()]
    ms = device.measure_decode(loaded, repeats=1)
    assert set(ms) == {"step", "prefill", "verify"} and all(set(m) == {"float32", "bfloat16"} for m in ms.values())
    assert all(0 < v < float("inf") for v in ms["prefill"].values())
    # step and verify are differences of minima: on the tiny target, noise-sized and finite (not always > 0)
    assert all(abs(v) < float("inf") for v in [*ms["step"].values(), *ms["verify"].values()])
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(before, loaded.dtype_tensors()))
    cast = loaded.cast("bfloat16", "why")
    ref = load_target(str(tmp_path), dtype="bfloat16")
    for got, want in ((dict(cast.model.named_buffers()), dict(ref.model.named_buffers())),
                      (cast.model.state_dict(), ref.model.state_dict())):
        assert got.keys() == want.keys()
        assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in got)
    assert cast.model.config.dtype == ref.model.config.dtype == torch.bfloat16 and cast.dtype_choice == "why"
    ids = torch.tensor([[5, 9, 14, 3, 7, 11]])
    assert torch.equal(cast.model(ids).logits, ref.model(ids).logits)
    prompts = [[5, 9, 14], [3, 7, 11, 2, 8]]
    assert plain_generate(cast, prompts, max_new_tokens=8)[0] == plain_generate(ref, prompts, max_new_tokens=8)[0]


def test_eval_on_an_avx2_cpu_runs_the_loop_in_the_measured_dtype(tmp_path, monkeypatch, caplog):
    """`draftkit eval --dtype auto` on an AVX2-only CPU: the loop runs in bfloat16 when its decode
    step was measured faster (the float32-loaded target cast, said in the log) and in float32
    when not; report.json records the per-stage choice, the measurement and the CPU flags."""
    from draftkit.cli import main as cli
    from draftkit.heads import build_head
    from tests.test_evaluate import chat_target

    target = chat_target()
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    build_head({"type": "eagle"}, target).save_pretrained(tmp_path / "run" / "head")
    cpu(monkeypatch)
    for bf16_ms, want in ((45.0, "bfloat16"), (90.0, "float32")):
        fake_timings(monkeypatch, {"float32": [74.0] * 3, "bfloat16": [bf16_ms] * 3})
        out = tmp_path / want
        args = ["eval", "--head", str(tmp_path / "run"), "--target", str(tmp_path / "target"), "--prompts",
                str(FIXTURES / "data" / "prompt.jsonl"), "--k", "2", "--max-new-tokens", "4", "--compare", "none",
                "--out", str(out)]
        caplog.clear()
        with caplog.at_level("INFO", logger="draftkit"):
            assert cli(args) == 0
        rep = json.loads((out / "report.json").read_text())
        stages = rep["dtype_stages"]
        assert rep["dtype"] == want and (stages["batched"], stages["decode"]) == ("float32", want)
        assert stages["decode_ms"] == pytest.approx({"float32": 74.0, "bfloat16": bf16_ms}, rel=1e-9)
        assert f"cpu flags: {AVX2}" in stages["line"]
        assert rep["dtype_choice"] == stages["line"] and stages["line"] in caplog.messages
        assert ("target cast float32 -> bfloat16" in caplog.text) == (want == "bfloat16")
