"""Finding a stage's blocks, addressing them by global id, and building a moved block without a factory."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from vpipe.migration.cloning import block_attrs, clone_block, set_block_attrs, validate_block_info
from vpipe.stage.blocks import (
    BlockContainerError,
    ContainerLayout,
    KeyStyle,
    StageBlocks,
    agree_key_style,
    find_block_container,
    global_ids,
)
from vpipe.stage.kinds import block_kind


class Block(nn.Module):
    def __init__(self, width: int = 8, index: int = 0) -> None:
        super().__init__()
        self.index = index  # a plain attribute its forward uses: it must travel with the block
        self.window = (index, 2 * index)
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        y = x + self.fc(self.norm(x)) * self.scale * (1 + 0.01 * self.index)
        return y if extra is None else y + extra


class TutorialStage(nn.Module):
    """The torch pipelining tutorial's shape: ModuleDict keyed by
    global id, None where a part does not belong."""

    def __init__(self, ids: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(1000, 8) if first else None
        self.layers = nn.ModuleDict({str(i): Block(index=i) for i in ids})
        self.norm = nn.LayerNorm(8) if last else None
        self.output = nn.Linear(8, 1000) if last else None


class HFStage(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.wte = nn.Embedding(5000, 8)  # more parameters than the blocks: still not a block container
        self.h = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(8)


def test_a_sequential_stage_is_its_own_container():
    module = nn.Sequential(Block(), nn.ReLU(), Block())
    assert find_block_container(module) == ("", module)


def test_the_tutorial_shape_finds_its_module_dict():
    stage = TutorialStage([4, 5, 6], first=False, last=True)
    assert find_block_container(stage) == ("layers", stage.layers)


def test_the_hand_split_hugging_face_shape_finds_its_module_list_next_to_a_larger_embedding():
    stage = HFStage([Block(), Block()])
    assert find_block_container(stage) == ("h", stage.h)


def test_one_block_on_a_stage_is_still_a_container():
    stage = HFStage([Block()])
    assert find_block_container(stage)[0] == "h"


def test_layers_option_names_the_container_and_bad_paths_say_what_is_wrong():
    stage = TutorialStage([0, 1], first=True, last=False)
    assert find_block_container(stage, "layers") == ("layers", stage.layers)
    with pytest.raises(BlockContainerError, match="has no submodule 'blocks'"):
        find_block_container(stage, "blocks")
    with pytest.raises(BlockContainerError, match="is a Embedding; it must name an nn.Sequential"):
        find_block_container(stage, "tok_embeddings")


def test_two_separate_containers_of_blocks_are_ambiguous_and_the_error_names_both():
    class EncoderDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.ModuleList([Block(), Block()])
            self.decoder = nn.ModuleList([Block(), Block(), Block()])

    with pytest.raises(BlockContainerError) as err:
        find_block_container(EncoderDecoder())
    message = str(err.value)
    assert "cannot decide" in message and "decoder (ModuleList of Block x3)" in message
    assert "encoder (ModuleList of Block x2)" in message and "layers='decoder'" in message


def test_a_stage_without_a_container_names_what_it_has_and_the_option():
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = Block()
            self.b = Block()
            self.acts = nn.ModuleList([nn.ReLU(), nn.ReLU()])  # no parameters: not blocks

    with pytest.raises(BlockContainerError) as err:
        find_block_container(Flat())
    assert "found no container of repeated blocks in the stage module (Flat)" in str(err.value)
    assert "acts (ModuleList of ReLU x2)" in str(err.value) and "layers='path.to.container'" in str(err.value)


def test_none_entries_and_an_empty_container_are_refused():
    stage = HFStage([Block(), Block()])
    stage.h._modules["1"] = None
    with pytest.raises(BlockContainerError, match=r"holds None at \['1'\]"):
        find_block_container(stage, "h")
    with pytest.raises(BlockContainerError, match="is empty"):
        find_block_container(nn.Sequential())


def test_key_styles_and_global_ids():
    tutorial = [ContainerLayout("layers", "ModuleDict", ("0", "1", "2")),
                ContainerLayout("layers", "ModuleDict", ("3",))]
    assert agree_key_style(tutorial) is KeyStyle.IDS
    assert global_ids(tutorial, KeyStyle.IDS) == [[0, 1, 2], [3]]
    slices = [ContainerLayout("", "Sequential", ("0", "1", "2")), ContainerLayout("", "Sequential", ("0",))]
    assert agree_key_style(slices) is KeyStyle.POSITIONS
    assert global_ids(slices, KeyStyle.POSITIONS) == [[0, 1, 2], [3]]
    hf = [ContainerLayout("h", "ModuleList", ("0",)), ContainerLayout("h", "ModuleList", ("0", "1"))]
    assert agree_key_style(hf) is KeyStyle.POSITIONS  # a ModuleList is positional even when keys look unique
    named = [ContainerLayout("", "Sequential", ("embed", "b0")),
             ContainerLayout("", "Sequential", ("b1", "head"))]
    assert agree_key_style(named) is KeyStyle.NAMES
    assert global_ids(named, KeyStyle.NAMES) == [[0, 1], [2, 3]]


def test_a_module_dict_keeps_global_id_keys_and_its_object_when_blocks_come_and_go():
    stage = TutorialStage([4, 5], first=False, last=True)
    container = stage.layers
    blocks = StageBlocks(container, [4, 5], KeyStyle.IDS, "layers")
    arriving = Block(index=3)
    blocks.insert(0, [(3, arriving, None)])
    assert stage.layers is container and list(container.keys()) == ["3", "4", "5"]
    assert blocks.ids == [3, 4, 5] and blocks.module_path(3) == "layers.3"
    gone = blocks.remove([5])
    assert [b.index for b in gone] == [5] and list(container.keys()) == ["3", "4"]
    fresh = TutorialStage([3, 4], first=False, last=True)
    fresh.load_state_dict(stage.state_dict())  # the user's checkpoint names still fit a freshly split model


def test_a_positional_container_is_renumbered_like_a_fresh_slice():
    stage = HFStage([Block(index=6), Block(index=7)])
    blocks = StageBlocks(stage.h, [6, 7], KeyStyle.POSITIONS, "h")
    blocks.insert(0, [(4, Block(index=4), "0"), (5, Block(index=5), "1")])
    assert list(stage.h._modules) == ["0", "1", "2", "3"] and [b.index for b in stage.h] == [4, 5, 6, 7]
    assert stage.h[2].index == 6  # ModuleList indexing still works
    blocks.remove([4])
    assert list(stage.h._modules) == ["0", "1", "2"] and blocks.key_of(7) == "2"
    assert blocks.blocks() == {5: stage.h[0], 6: stage.h[1], 7: stage.h[2]}


def test_name_keyed_blocks_bring_their_key():
    container = nn.Sequential(OrderedDict(a=Block(), b=Block()))
    blocks = StageBlocks(container, [0, 1], KeyStyle.NAMES)
    blocks.insert(2, [(2, Block(), "c")])
    assert list(container._modules) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="already has entries named"):
        blocks.insert(0, [(3, Block(), "a")])


def test_a_clone_has_the_donors_structure_but_none_of_its_hooks_values_or_routed_forward():
    donor = Block(index=2)
    calls = []
    donor.register_forward_hook(lambda *a: calls.append("hook"))
    donor.fc.register_forward_pre_hook(lambda *a: calls.append("pre"))
    routed = lambda *a, **k: calls.append("routed")  # noqa: E731
    routed._vpipe_routed_forward = True
    donor.forward = routed
    clone = clone_block(donor)
    assert "forward" not in vars(clone) and block_kind(clone) == block_kind(donor)
    assert [n for n, _ in clone.named_parameters()] == [n for n, _ in donor.named_parameters()]
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(clone.parameters(), donor.parameters()))
    clone.load_state_dict(Block(index=2).state_dict())
    clone(torch.randn(3, 8))
    assert calls == []  # neither the donor's hooks nor its routed forward came along
    assert len(donor._forward_hooks) == 1 and "forward" in vars(donor)  # the donor is untouched


def test_plain_attributes_travel_and_a_different_kind_of_block_is_refused():
    moved = Block(index=5)
    attrs = block_attrs(moved)
    assert attrs[""]["index"] == 5 and attrs[""]["window"] == [5, 10]
    clone = clone_block(Block(index=1))
    set_block_attrs(clone, attrs, 5)
    assert clone.index == 5 and clone.window == (5, 10)  # tuples come back as tuples
    x = torch.randn(2, 8)
    moved.eval(), clone.eval()
    clone.load_state_dict(moved.state_dict())
    assert torch.equal(clone(x), moved(x))
    other = clone_block(Block())
    other.extra_flag = True
    with pytest.raises(ValueError, match="not the same kind of block"):
        set_block_attrs(other, attrs, 5)
    assert block_kind(Block(width=4)) != block_kind(Block(width=8))


@pytest.mark.parametrize("info, match", [
    ({"kind": "Block#1", "key": "0"}, "must have kind, key and attrs"),
    ({"kind": "", "key": None, "attrs": {}}, "bad block kind"),
    ({"kind": "Block#1", "key": "a.b", "attrs": {}}, "bad block key"),
    ({"kind": "Block#1", "key": None, "attrs": {"": {"_parameters": 1}}}, "bad block attribute name"),
    ({"kind": "Block#1", "key": None, "attrs": {"": {"forward": 1}}}, "bad block attribute name"),
    ({"kind": "Block#1", "key": None, "attrs": {"": {"x": {"nested": 1}}}}, "is not a plain value"),
    ({"kind": "Block#1", "key": None, "attrs": ["x"]}, "must be a map"),
])
def test_a_block_description_from_a_peer_is_validated(info, match):
    with pytest.raises(ValueError, match=match):
        validate_block_info(info, 3)


def test_stages_that_chose_differently_agree_on_the_container_holding_every_choice():
    """Dense and MoE blocks interleaved: a stage of one dense and one MoE block picks
    the experts of its MoE block, a stage of many blocks picks ``layers``; the path
    every stage uses is ``layers``, which holds both kinds."""
    from vpipe.stage.blocks import BlockContainerError, common_container

    assert common_container([("layers.1.experts", ["layers", "layers.1.experts"]),
                             ("layers", ["layers", "layers.7.experts"])]) == "layers"
    assert common_container([("layers.1.experts", ["layers", "layers.1.experts"]),
                             ("layers.3.experts", ["layers", "layers.3.experts"])]) == "layers"
    assert common_container([("transformer.h", ["transformer", "transformer.h"])] * 2) == "transformer.h"
    with pytest.raises(BlockContainerError, match="the stages found different block containers \\(stage 0 "
                                                  "'enc.layers', stage 1 'dec.layers'\\); .*pass layers="):
        common_container([("enc.layers", ["enc.layers"]), ("dec.layers", ["dec.layers"])])
