"""Tests for pytest_npu_parity.structure: the configuration and structure record of a module."""
from __future__ import annotations

import copy
import enum

import pytest
import torch
from torch import nn

from pytest_npu_parity.structure import (
    config_dict,
    module_structure,
    pack_structure,
    structure_changes,
    structure_hash,
    train_recipe,
    train_recipe_changes,
    unpack_structure,
)


class FakeConfig:
    """Duck-typed like transformers' PretrainedConfig: ``to_dict`` and ``to_json_string``."""

    def __init__(self, **values):
        self.values = values

    def to_dict(self):
        return copy.deepcopy(self.values)

    def to_json_string(self):  # pragma: no cover - only its presence matters
        return repr(self.values)


class Block(nn.Module):
    def __init__(self, eps: float = 1e-5, config: FakeConfig | None = None):
        super().__init__()
        self.config = config or FakeConfig(hidden=8, layer_norm_epsilon=eps, transformers_version="4.57.6",
                                           _name_or_path="/home/me/ckpt", dtype="float32", torch_dtype="float32",
                                           vision_config={"hidden": 4, "transformers_version": "4.57.6"})
        self.norm = nn.LayerNorm(8, eps=eps)
        self.proj = nn.Linear(8, 8)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.act(self.proj(self.norm(x))))


def test_the_record_names_every_module_with_its_class_and_plain_attributes():
    record = module_structure(Block().eval())
    assert list(record["modules"]) == ["", "norm", "proj", "act", "drop"]
    assert record["modules"]["norm"] == ["LayerNorm", {"training": False, "normalized_shape": [8], "eps": 1e-05,
                                                        "elementwise_affine": True}]
    assert record["modules"]["proj"][1] == {"training": False, "in_features": 8, "out_features": 8}
    assert record["modules"]["act"][1]["approximate"] == "none"
    assert record["modules"]["drop"][1] == {"training": False, "p": 0.1, "inplace": False}
    assert "config" not in record["modules"][""][1]  # recorded as a config, not as an attribute


def test_configs_leave_out_volatile_and_private_keys_and_flatten_nested_ones():
    record = module_structure(Block())
    assert record["configs"] == {"config": {"hidden": 8, "layer_norm_epsilon": 1e-05, "vision_config.hidden": 4}}
    assert config_dict(object()) is None and config_dict({"a": 1}) is None


def test_a_shared_config_is_recorded_once_and_a_sub_models_own_config_under_its_path():
    shared = FakeConfig(hidden=8)
    model = nn.Sequential(Block(config=shared), Block(config=shared), Block(config=FakeConfig(hidden=4)))
    model.config = shared
    assert sorted(module_structure(model)["configs"]) == ["2.config", "config"]


def test_odd_attributes_are_left_out_and_plain_ones_kept():
    class Mode(enum.Enum):
        FAST = 1

    layer = nn.Linear(2, 2)
    layer.cache = {"warnings": True}  # runtime state
    layer.where = torch.device("cpu")  # placement
    layer.tokenizer = object()
    layer.mode, layer.heads, layer.kind, layer.fn = Mode.FAST, {3, 1}, torch.float16, torch.tanh
    layer.nan = float("nan")
    attributes = module_structure(layer)["modules"][""][1]
    assert not {"cache", "where", "tokenizer", "_parameters"} & set(attributes)
    assert attributes["mode"] == "Mode.FAST" and attributes["heads"] == [1, 3]
    assert attributes["kind"] == "torch.float16" and attributes["fn"] == "<function tanh>"
    assert attributes["nan"] == "nan"


def test_modes_false_leaves_out_the_training_flags():
    record = module_structure(Block(), modes=False)
    assert all("training" not in attrs for _cls, attrs in record["modules"].values())


def test_hash_and_packed_form_round_trip():
    record = module_structure(Block())
    packed = pack_structure(record)
    assert packed.startswith("zlib+base64:")
    assert unpack_structure(packed) == record
    assert structure_hash(unpack_structure(packed)) == structure_hash(record)
    assert structure_hash(module_structure(Block(eps=1e-3))) != structure_hash(record)
    for bad in ("", "zlib+base64:!!!", "zlib+base64:" + "eJw=", None, pack_structure({"format": 99})):
        with pytest.raises(ValueError):
            unpack_structure(bad)


def test_a_changed_config_value_is_named_with_both_values():
    before, after = module_structure(Block(eps=1e-5)), module_structure(Block(eps=1e-3))
    assert structure_changes(before, after) == [
        "config changed: layer_norm_epsilon 1e-05 → 0.001",
        "structure changed (1 of 5 modules differ, e.g. 'norm': eps 1e-05 → 0.001)",
    ]


def test_class_mode_attribute_added_and_removed_modules_are_named():
    model = Block().eval()
    before = module_structure(model)
    model.act = nn.ReLU()
    model.drop.train()
    model.proj = nn.Linear(8, 8, bias=False).eval()  # same attributes: the weights' digests see the bias go
    model.extra = nn.Identity()
    del model.norm
    lines = structure_changes(before, module_structure(model), prefix="model.block")
    assert lines == ["structure changed (2 of 6 modules differ, e.g. 'model.block.act': GELU → ReLU, "
                     "'model.block.drop': eval → train mode; 1 new: 'model.block.extra'; 1 gone: 'model.block.norm')"]


def test_only_fields_both_records_have_are_compared():
    """A field one side lacks (added by another torch or transformers release) is no change."""
    before = module_structure(Block())
    after = copy.deepcopy(before)
    after["modules"]["norm"][1]["bias"] = True  # e.g. a newer LayerNorm attribute
    after["configs"]["config"]["new_key"] = 0
    del after["modules"]["proj"][1]["in_features"]
    assert structure_hash(after) != structure_hash(before)
    assert structure_changes(before, after) == []


def test_many_changes_are_summarized():
    before = module_structure(nn.Sequential(*[nn.LayerNorm(4) for _ in range(5)]))
    after = module_structure(nn.Sequential(*[nn.LayerNorm(4, eps=1e-3) for _ in range(5)]))
    (line,) = structure_changes(before, after)
    assert line == ("structure changed (5 of 6 modules differ, e.g. '0': eps 1e-05 → 0.001, '1': eps 1e-05 → 0.001, "
                    "'2': eps 1e-05 → 0.001, …)")


def test_the_record_does_not_change_when_the_module_runs():
    """Forwards (and HF's generate) must not set public attributes the record would see."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32,
                                                                 n_positions=16)).eval()
    before = module_structure(model)
    ids = torch.randint(0, 32, (1, 4))
    model(input_ids=ids)
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                   pad_token_id=0)
    assert structure_hash(module_structure(model)) == structure_hash(before)
    assert set(before["configs"]) == {"config", "generation_config"}
    assert "transformers_version" not in before["configs"]["config"]
    assert "_name_or_path" not in before["configs"]["config"] and "dtype" not in before["configs"]["config"]


# Recorded with torch 2.14.1 (module_structure of the modules below). CI runs this file under torch
# 2.14.1 and 2.5.1: the records of both must agree wherever both have a field (extra_repr() does
# not: 2.14.1 prints LayerNorm's bias=, 2.5.1 does not).
RECORDED_2_14 = {
    "layer_norm": ["LayerNorm", {"training": True, "normalized_shape": [8], "eps": 1e-05, "elementwise_affine": True}],
    "linear": ["Linear", {"training": True, "in_features": 8, "out_features": 4}],
    "conv": ["Conv2d", {"training": True, "in_channels": 3, "out_channels": 8, "kernel_size": [3, 3], "stride": [1, 1],
                        "padding": [1, 1], "dilation": [1, 1], "transposed": False, "output_padding": [0, 0],
                        "groups": 1, "padding_mode": "zeros"}],
    "batch_norm": ["BatchNorm2d", {"training": True, "num_features": 8, "eps": 1e-05, "momentum": 0.1, "affine": True,
                                   "track_running_stats": True}],
    "lstm": ["LSTM", {"training": True, "mode": "LSTM", "input_size": 8, "hidden_size": 16, "num_layers": 2,
                      "bias": True, "batch_first": True, "dropout": 0.0, "bidirectional": False, "proj_size": 0}],
    "gelu": ["GELU", {"training": True, "approximate": "tanh"}],
}


def test_torch_modules_record_the_same_under_every_supported_torch():
    modules = {"layer_norm": nn.LayerNorm(8), "linear": nn.Linear(8, 4), "conv": nn.Conv2d(3, 8, 3, padding=1),
               "batch_norm": nn.BatchNorm2d(8), "lstm": nn.LSTM(8, 16, num_layers=2, batch_first=True),
               "gelu": nn.GELU(approximate="tanh")}
    for name, module in modules.items():
        now = module_structure(module)
        recorded = {"format": 1, "modules": {"": RECORDED_2_14[name]}, "configs": {}}
        assert structure_changes(recorded, now) == [], name
        assert now["modules"][""][0] == RECORDED_2_14[name][0]


def _params() -> list[nn.Parameter]:
    return list(nn.Linear(3, 2).parameters())


def test_a_train_recipe_is_plain_json_naming_optimizer_clipping_and_loss():
    import json

    opt = torch.optim.AdamW([{"params": _params()[:1]}, {"params": _params()[1:], "lr": 1e-3}],
                            lr=1e-4, betas=(0.9, 0.95))
    record = train_recipe(opt, 1.0, nn.CrossEntropyLoss(label_smoothing=0.1, ignore_index=-1))
    assert json.loads(json.dumps(record)) == record
    assert record["optimizer"] == "AdamW" and record["optimizer.betas"] == [0.9, 0.95]
    assert record["optimizer.param_groups"] == [1, 1]
    assert record["optimizer.group0.lr"] == 1e-4 and record["optimizer.group1.lr"] == 1e-3
    assert not any(k.endswith(".params") for k in record)
    assert record["max_grad_norm"] == 1.0 and record["loss"] == "CrossEntropyLoss"
    assert (record["loss.label_smoothing"], record["loss.ignore_index"], record["loss.reduction"]) == (0.1, -1, "mean")
    assert "loss.training" not in record
    assert train_recipe(opt, None, None)["loss"] == "output.loss"
    assert train_recipe(opt, None, torch.nn.functional.mse_loss)["loss"] == "torch.nn.functional.mse_loss"


def test_a_loop_recipe_names_its_class_and_settings_and_a_config_path_by_its_file_name():
    from pytest_npu_parity.hf_trainer import TrainerLoop

    record = train_recipe(loop=TrainerLoop(steps=3, batch_size=2, deepspeed_config="/somewhere/zero2.json"))
    assert record["loop"] == "TrainerLoop" and "optimizer" not in record and "loss" not in record
    assert (record["loop.steps"], record["loop.batch_size"], record["loop.deepspeed_config"]) == (3, 2, "zero2.json")
    later = train_recipe(loop=TrainerLoop(steps=5, batch_size=2, deepspeed_config="/elsewhere/zero2.json"))
    assert train_recipe_changes(record, later) == ["train recipe changed: loop.steps 3 → 5"]


def test_train_recipe_changes_name_the_optimizer_and_its_hyperparameters():
    adamw = train_recipe(torch.optim.AdamW(_params(), lr=1e-4), 1.0, None)
    sgd = train_recipe(torch.optim.SGD(_params(), lr=0.01), 1.0, None)
    assert train_recipe_changes(adamw, sgd) == [
        "train recipe changed: optimizer AdamW → SGD, lr 0.0001 → 0.01, weight_decay 0.01 → 0"]
    faster = train_recipe(torch.optim.AdamW(_params(), lr=1e-3), 1.0, None)
    assert train_recipe_changes(adamw, faster) == ["train recipe changed: lr 0.0001 → 0.001"]
    assert train_recipe_changes(adamw, train_recipe(torch.optim.AdamW(_params(), lr=1e-4), 1.0, None)) == []
    l1 = train_recipe(torch.optim.AdamW(_params(), lr=1e-4), None, nn.L1Loss())
    assert train_recipe_changes(train_recipe(torch.optim.AdamW(_params(), lr=1e-4), None, nn.MSELoss()), l1) == [
        "train recipe changed: loss MSELoss → L1Loss"]


def test_train_recipe_changes_compare_only_keys_both_have_but_always_the_optimizer_and_loss():
    now = train_recipe(torch.optim.AdamW(_params(), lr=1e-4), 1.0, None)
    older = {k: v for k, v in now.items() if "decoupled_weight_decay" not in k}  # a release without the field
    older["optimizer.some_old_field"] = 1
    assert train_recipe_changes(older, now) == []
    without_loss = {k: v for k, v in now.items() if k != "loss"}
    assert train_recipe_changes(without_loss, now) == ["train recipe changed: loss None → output.loss"]
    grouped = train_recipe(torch.optim.AdamW([{"params": _params()}, {"params": _params(), "lr": 1.0}], lr=1e-4),
                           1.0, None)
    assert "param_groups [2] → [2, 2]" in train_recipe_changes(now, grouped)[0]
