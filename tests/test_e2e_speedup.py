"""benchmarks/e2e_speedup.py's config parsing: which head each interleaved config drafts with."""
import pytest

from benchmarks.e2e_speedup import config_head, parse_config, parse_heads


def test_configs_name_their_head_and_an_unnamed_one_is_refused_among_several():
    heads = parse_heads(["eagle3=runs/e3/head", "dflash=runs/df/head"])
    assert heads == {"eagle3": "runs/e3/head", "dflash": "runs/df/head"}
    s, named = parse_config("chain k=7 head=dflash")
    assert (s.mode, s.k, named) == ("chain", 7, "dflash") and config_head("c", named, heads) == "dflash"
    with pytest.raises(SystemExit, match="several heads given"):
        config_head("chain k=3", None, heads)
    with pytest.raises(SystemExit, match="head=medusa is not one of"):
        config_head("chain k=3 head=medusa", "medusa", heads)
    one = parse_heads(["runs/e/head"])  # the old form: one bare directory, used by every config
    assert one == {"head": "runs/e/head"} and config_head("chain k=3", None, one) == "head"
    assert config_head("lookup lookup_len=8", None, {}) is None
    with pytest.raises(SystemExit, match="distinct names"):
        parse_heads(["a=x", "a=y"])
