"""The module copies a run makes (runtime.side): ``fresh_copy`` (training-mode forward: new buffers and
submodule objects, shared weights) and ``trainable_copy`` (training step: everything new), both through
``module_copy_memo``, must be what ``copy.deepcopy`` makes: no container of the copy shared with the
original, the same structure and values."""
from __future__ import annotations

import copy

import torch

from pytest_npu_parity.runtime.side import fresh_copy, module_copy_memo, trainable_copy


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU())
        self.head = torch.nn.Linear(8, 2)
        self.history: list = []      # a plain mutable attribute a forward may append to
        self.cache: dict = {}        # an empty dict of the model's own
        self.body[0].register_forward_hook(lambda m, i, o: None)  # one non-empty hook table

    def forward(self, x):
        self.history.append(1)
        self.cache["last"] = x.shape
        return self.head(self.body(x))


def _containers(module: torch.nn.Module) -> list[tuple[str, str, object]]:
    return [(path, name, value) for path, sub in module.named_modules() for name, value in vars(sub).items()
            if isinstance(value, (dict, set, list))]


def _same_structure(a: torch.nn.Module, b: torch.nn.Module) -> None:
    assert [(p, type(m)) for p, m in a.named_modules()] == [(p, type(m)) for p, m in b.named_modules()]
    for (path, name, x), (_, _, y) in zip(_containers(a), _containers(b)):
        assert type(x) is type(y) and len(x) == len(y), (path, name)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_memo_copy_is_deepcopy():
    net = _Net().train()
    plain = copy.deepcopy(net)
    memo = copy.deepcopy(net, memo=module_copy_memo(net))
    _same_structure(plain, memo)
    original = {id(v) for _, _, v in _containers(net)}
    assert not original & {id(v) for _, _, v in _containers(memo)}, "a container is shared with the original"


def test_fresh_copy_shares_weights_only():
    net = _Net().train()
    copied = fresh_copy(net)
    _same_structure(net, copied)
    assert all(a is b for a, b in zip(net.parameters(), copied.parameters()))
    assert not any(a is b for a, b in zip(net.buffers(), copied.buffers()))
    before = {k: v.clone() for k, v in net.state_dict().items() if "running" in k or "num_batches" in k}
    copied(torch.randn(5, 4))
    copied.body[1].register_forward_hook(lambda m, i, o: None)
    # the original's buffers, attributes and hook tables are untouched by the copy's forward and hooks
    assert all(torch.equal(net.state_dict()[k], v) for k, v in before.items())
    assert net.history == [] and net.cache == {}
    assert len(net.body[1]._forward_hooks) == 0 and len(net.body[0]._forward_hooks) == 1


def test_trainable_copy_shares_nothing():
    net = _Net()
    copied = trainable_copy(net)
    _same_structure(net, copied)
    assert not any(a is b for a, b in zip(net.parameters(), copied.parameters()))
    assert all(p.is_leaf and p.requires_grad for p in copied.parameters())
    with torch.no_grad():
        copied.head.weight.add_(1.0)
    assert not torch.equal(net.head.weight, copied.head.weight)


class _ResetsCache(torch.nn.Module):
    """Drops its cache when copied: ``__getstate__`` replaces the (empty) cache dict of the original and
    builds its state in a new dict, which CPython's dict free list gives the freed dict's address."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.cache: dict = {}

    def forward(self, x):
        return self.lin(x)

    def __getstate__(self):
        self.cache = {}
        state: dict = {}
        state.update(self.__dict__)
        return state


def test_memo_keeps_the_originals_alive_like_deepcopy():
    # A container freed during the copy must not leave its memo entry to a new object at its address.
    net = torch.nn.Sequential(_ResetsCache(), torch.nn.Linear(3, 1))
    x = torch.ones(2, 3)
    for copied in (copy.deepcopy(net, memo=module_copy_memo(net)), fresh_copy(net), trainable_copy(net)):
        assert sorted(vars(copied[0])) == sorted(vars(net[0]))
        assert torch.equal(copied(x), net(x))
