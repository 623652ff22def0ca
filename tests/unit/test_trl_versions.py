"""The weight version of each token, read from vLLM's `weight_versions` spans (TRL integration)."""

from weightsvc.integrations.trl import UNKNOWN_VERSION, token_versions


def test_a_request_across_an_update_has_the_tokens_of_both_versions() -> None:
    spans = [{"version": "7", "start": 0, "end": 3}, {"version": "8", "start": 3, "end": 5}]
    assert token_versions(spans, 5) == [7, 7, 7, 8, 8]


def test_tokens_without_a_weightsvc_version_are_marked_unknown() -> None:
    # An engine label that is no weightsvc version (the checkpoint's, or one mid-update), no spans at all,
    # and tokens past the last span: none is counted under a version.
    spans = [{"version": "weightsvc-updating-3", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 3}]
    assert token_versions(spans, 4) == [UNKNOWN_VERSION, UNKNOWN_VERSION, 3, UNKNOWN_VERSION]
    assert token_versions(None, 2) == [UNKNOWN_VERSION] * 2


def test_spans_past_the_completion_are_cut_to_it() -> None:
    assert token_versions([{"version": "1", "start": 0, "end": 9}], 3) == [1, 1, 1]
