"""The blocks :func:`galva_models.stored_parts.stored_parts` finds are what ``save_pretrained`` writes, value for
value, and a save conversion that is no set of blocks is refused in one line."""

from __future__ import annotations

import pytest
import torch

from galva_models.presets import tiny_config
from galva_models.stored_parts import stored_parts
from galva_models.tables import ADAPTER


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_each_part_is_the_tensor_transformers_writes(family: str) -> None:
    """Every parameter's parts, cut from the real tensor, equal transformers' own save-time conversion of it (the
    fused experts: one tensor per expert and projection; the rest: the tensor, renamed at most)."""
    from transformers.core_model_loading import revert_weight_conversion

    torch.manual_seed(0)
    model = ADAPTER.build_model(tiny_config(family))
    split = 0
    for name, param in model.named_parameters():
        parts = stored_parts(model, name, tuple(param.shape))
        written = revert_weight_conversion(model, {name: param.detach()})
        assert sorted(p.tensor for p in parts) == sorted(written), name
        for part in parts:
            block = param.detach()[tuple(slice(o, o + s) for o, s in zip(part.offsets, part.sizes))]
            assert torch.equal(part.to_disk(block), written[part.tensor]), part.tensor
            assert torch.equal(part.from_disk(written[part.tensor], part.sizes), block), part.tensor
        split += len(parts) > 1
    assert split == 2 * (model.config.num_hidden_layers - getattr(model.config, "first_k_dense_replace", 0))


def test_a_transposing_conversion_is_one_part_with_its_axes_swapped() -> None:
    """A conversion that stores a weight transposed (Qwen3-VL-MoE's experts) is one part whose axes are swapped,
    and cutting and restoring through it matches transformers' own conversion."""
    from transformers.core_model_loading import Transpose, WeightConverter, revert_weight_conversion

    model = ADAPTER.build_model(tiny_config("llama"))
    model._weight_conversions = [
        WeightConverter("mlp.up_proj.weight", "mlp.up_proj.weight", operations=[Transpose(0, 1)])
    ]
    name = "model.layers.0.mlp.up_proj.weight"
    param = model.get_parameter(name).detach()
    (part,) = stored_parts(model, name, tuple(param.shape))
    assert (part.tensor, part.axes, part.shape) == (name, (1, 0), tuple(param.shape[::-1]))
    written = revert_weight_conversion(model, {name: param})[name]
    assert torch.equal(part.to_disk(param), written) and torch.equal(part.from_disk(written, part.sizes), param)


def test_a_conversion_that_copies_is_refused_in_one_line() -> None:
    """An interleaving conversion (reshape after a transpose: a copy, no block) names the tensor."""
    from transformers.core_model_loading import Interleave, WeightConverter

    model = ADAPTER.build_model(tiny_config("llama"))
    model._weight_conversions = [
        WeightConverter("mlp.up_proj.weight", "mlp.up_proj.weight", operations=[Interleave(dim=0)])
    ]
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError) as err:
        stored_parts(model, name, tuple(model.get_parameter(name).shape))
    assert str(err.value).startswith(f"{name}: transformers converts this weight on save into ")
    assert "\n" not in str(err.value)
