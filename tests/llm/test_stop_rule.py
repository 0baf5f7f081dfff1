"""StopRule: the one place the runner asks, after each new token, whether generation ends and why."""
from execupy.llm.runner import StopRule

EOS = 2
rule = StopRule(eos_ids=frozenset({EOS}), stop_strings=("END",), max_new_tokens=3, max_seq_len=10)


def test_each_reason_in_its_order():
    # An end-of-sequence token wins, even as the last allowed token of a full cache.
    assert rule.why_stop(EOS, 3, "", "", cache_len=10) == "eos"
    # A stop string that the newest piece completes, even across pieces.
    assert rule.why_stop(5, 2, "the EN" + "D", "D", cache_len=0) == "stop_string"
    assert rule.why_stop(5, 3, "the END", "D", cache_len=10) == "stop_string"
    assert rule.why_stop(5, 3, "abc", "c", cache_len=10) == "max_new_tokens"
    # The last sampled token still has to be fed before another can be sampled.
    assert rule.why_stop(5, 1, "abc", "c", cache_len=10) == "context"


def test_none_while_generation_goes_on():
    assert rule.why_stop(5, 1, "abc", "c", cache_len=9) is None
    assert rule.why_stop(5, 2, "the END", "", cache_len=0) is None  # no new text: the old match was seen before
    ignoring_eos = StopRule(eos_ids=frozenset(), stop_strings=(), max_new_tokens=3, max_seq_len=10)
    assert ignoring_eos.why_stop(EOS, 1, "", "", cache_len=0) is None
