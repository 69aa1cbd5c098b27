"""wrapped_optim._rollback behaviour that mutation testing found unchecked: each test kills
mutants the other rollback tests let survive (docs/contributing/mutation.md lists them)."""

from __future__ import annotations

import pytest
import torch

from wrapped_optim._rollback import OptimizerSnapshot, copy_all, deep_clone


def test_deep_clone_copies_lists_and_tuples_with_their_tensors() -> None:
    """Kills deep_clone mutants 4-6: the list/tuple branch returning ``type(value)(None)``,
    ``type(None)(...)``, or cloning ``None`` instead of each item."""
    tensor = torch.arange(3.0)
    value = {"betas": (0.9, tensor), "history": [tensor, [tensor, 2]]}
    copy = deep_clone(value)
    assert type(copy["betas"]) is tuple and type(copy["history"]) is list
    assert copy["betas"][0] == 0.9 and copy["history"][1][1] == 2
    for cloned in (copy["betas"][1], copy["history"][0], copy["history"][1][0]):
        assert torch.equal(cloned, tensor) and cloned.data_ptr() != tensor.data_ptr()


def test_copy_all_copies_every_pair_reshaping_each_source() -> None:
    a, b, c = torch.zeros(4), torch.zeros(2, 3), torch.zeros(1)
    copy_all([(a, torch.arange(4.0).reshape(2, 2)), (b, torch.ones(6)), (c, torch.full((1,), 7.0))])
    assert a.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert b.tolist() == [[1.0] * 3] * 2 and c.tolist() == [7.0]
    copy_all([])  # nothing to copy is not an error


@pytest.mark.parametrize("failing", [1, 2, 3])
def test_copy_all_undoes_every_earlier_copy_when_one_fails(failing: int) -> None:
    """All or nothing: the pair at ``failing`` cannot be copied (its sizes differ), so every
    target before it holds its old value again and the copy's own error reaches the caller."""
    targets = [torch.full((2,), float(i)) for i in range(4)]
    pairs = [(t, torch.full((2,), 10.0 + i)) for i, t in enumerate(targets)]
    pairs[failing] = (targets[failing], torch.ones(3))
    with pytest.raises(RuntimeError, match="shape"):
        copy_all(pairs)
    assert [t.tolist() for t in targets] == [[float(i)] * 2 for i in range(4)]


def test_group_options_put_a_tensor_option_back_into_the_same_tensor() -> None:
    """A scheduler that writes a tensor ``lr`` in place changes the group's own tensor: the
    restore must copy the old value back into it, not keep the object it finds."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p], lr=torch.tensor(0.01))
    lr = opt.param_groups[0]["lr"]
    snapshot = OptimizerSnapshot.take(opt)
    lr.fill_(0.5)
    snapshot.restore()
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.01)


def test_whole_snapshot_drops_state_entries_under_keys_that_are_not_params() -> None:
    """A failed load may have filed state under a tensor that is none of the optimizer's
    params; a snapshot of the whole optimizer gives back exactly the entries it had."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(2)
    opt.step()
    snapshot = OptimizerSnapshot.take(opt)
    stray = torch.zeros(2)
    opt.state[stray] = {"momentum_buffer": torch.ones(2)}
    snapshot.restore()
    assert list(opt.state) == [p]
    partial = OptimizerSnapshot.take(opt, [p])  # a partial one leaves other keys alone
    opt.state[stray] = {"momentum_buffer": torch.ones(2)}
    partial.restore()
    assert stray in opt.state


def test_a_dict_keyed_by_other_tensors_too_is_not_rolled_back() -> None:
    """Only a dict whose keys are all the optimizer's params is its per-param state; a dict
    that also holds other tensors (a user's table keyed by model tensors) is left as is."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    other = torch.zeros(1)
    opt.mixed = {p: 1, other: 2}  # type: ignore[attr-defined]
    opt.scales = {p: torch.ones(1)}  # type: ignore[attr-defined]
    snapshot = OptimizerSnapshot.take(opt)
    opt.mixed[p] = 3  # type: ignore[attr-defined]
    opt.scales[p] = torch.zeros(1)  # type: ignore[attr-defined]
    snapshot.restore()
    assert opt.mixed == {p: 3, other: 2}  # type: ignore[attr-defined]
    assert opt.scales[p].tolist() == [1.0]  # type: ignore[attr-defined]
