"""The dispatch contract: order, decline -> fallback, forcing, last_path, determinism flag."""

import itertools

import pytest

import cudnn_train
from cudnn_train import backend
from cudnn_train.backend import Op, Served, Unsupported

_ids = itertools.count()


def make_op(decline_first: str | None = None, raise_in: str | None = None):
    calls = []
    op = Op(f"test_op_{next(_ids)}", ["fast", "peer", "torch"])

    @op.register("fast")
    def _fast(x):
        calls.append("fast")
        if decline_first:
            raise Unsupported(decline_first)
        if raise_in == "fast":
            raise RuntimeError("kernel bug")
        return Served(x + 1, "sm90")

    @op.register("peer")
    def _peer(x):
        calls.append("peer")
        return x + 1

    @op.register("torch")
    def _torch(x):
        calls.append("torch")
        return x + 1

    return op, calls


def test_first_backend_serves_with_tag():
    op, calls = make_op()
    assert op(1) == 2
    assert calls == ["fast"]
    assert cudnn_train.last_path(op.name) == "fast:sm90"


def test_decline_falls_back_with_reason():
    op, calls = make_op(decline_first="no GPU")
    assert op(1) == 2
    assert calls == ["fast", "peer"]
    assert cudnn_train.last_path(op.name) == "peer:fallback(no GPU)"


def test_other_errors_propagate():
    op, calls = make_op(raise_in="fast")
    with pytest.raises(RuntimeError, match="kernel bug"):
        op(1)
    assert calls == ["fast"]


def test_use_backend_forces_and_restores():
    op, calls = make_op()
    with cudnn_train.use_backend("torch"):
        assert op(1) == 2
        assert cudnn_train.last_path(op.name) == "torch:forced"
    assert op(1) == 2
    assert calls == ["torch", "fast"]


def test_forced_backend_that_declines_raises_with_reason():
    op, _ = make_op(decline_first="D=96 unsupported")
    with cudnn_train.use_backend("fast"):
        with pytest.raises(Unsupported, match="D=96 unsupported"):
            op(1)


def test_forced_preference_list_falls_back():
    op, calls = make_op(decline_first="nope")
    with cudnn_train.use_backend("fast,torch"):
        assert op(1) == 2
    assert calls == ["fast", "torch"]
    assert cudnn_train.last_path(op.name) == "torch:fallback(nope)"


def test_env_var_forces(monkeypatch):
    op, calls = make_op()
    monkeypatch.setenv("CUDNN_TRAIN_BACKEND", "peer")
    assert op(1) == 2
    assert calls == ["peer"]
    assert cudnn_train.last_path(op.name) == "peer:forced"


def test_forcing_a_backend_the_op_lacks_raises():
    op, _ = make_op()
    with cudnn_train.use_backend("fla"):
        with pytest.raises(Unsupported, match="none of the forced backends"):
            op(1)


def test_every_backend_declining_raises():
    op = Op(f"test_op_{next(_ids)}", ["a", "b"])

    @op.register("a")
    def _a():
        raise Unsupported("ra")

    @op.register("b")
    def _b():
        raise Unsupported("rb")

    with pytest.raises(Unsupported, match="ra.*rb"):
        op()


def test_register_rejects_unknown_backend_and_duplicate_op():
    op, _ = make_op()
    with pytest.raises(ValueError):
        op.register("nonexistent")
    with pytest.raises(ValueError):
        Op(op.name, ["torch"])


def test_deterministic_function_and_context(monkeypatch):
    monkeypatch.delenv("CUDNN_TRAIN_DETERMINISTIC", raising=False)
    backend._det_global[0] = None
    assert not cudnn_train.is_deterministic()
    monkeypatch.setenv("CUDNN_TRAIN_DETERMINISTIC", "1")
    assert cudnn_train.is_deterministic()
    monkeypatch.delenv("CUDNN_TRAIN_DETERMINISTIC")
    with cudnn_train.deterministic(True):
        assert cudnn_train.is_deterministic()
        with cudnn_train.deterministic(False):
            assert not cudnn_train.is_deterministic()
        assert cudnn_train.is_deterministic()
    assert not cudnn_train.is_deterministic()
    cudnn_train.deterministic(True)
    try:
        assert cudnn_train.is_deterministic()
    finally:
        backend._det_global[0] = None


def test_last_path_of_all_ops_is_a_dict():
    op, _ = make_op()
    op(1)
    paths = cudnn_train.last_path()
    assert paths[op.name] == "fast:sm90"
