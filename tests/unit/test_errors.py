"""Every message names what it is about the same way."""

from __future__ import annotations

from weightsvc.errors import subject


def test_subject_names_model_version_tensor_and_rank_in_that_order() -> None:
    assert subject("policy", 7) == "model 'policy' version 7"
    assert subject("policy", step=8) == "model 'policy' step 8"
    assert subject("policy", 7, tensor="w.weight", rank=1) == "model 'policy' version 7 tensor 'w.weight' rank 1"
    assert subject("a'b", "latest") == "model \"a'b\" version latest"  # repr: a name is never ambiguous
    assert subject("policy") == "model 'policy'"
