from hostile.refusal import assert_refused, run_cli, tree_digest


def test_a_missing_checkpoint_is_refused_by_name(tmp_path):
    before = tree_digest(tmp_path)
    assert_refused(run_cli("validate", tmp_path / "nope"), "nope")
    assert tree_digest(tmp_path) == before
