"""Block swap keeps the math: loss and LoRA gradients bit for bit equal to the unswapped model's.

On CPU the "device" and "host" placements are both the CPU, but every swapped block's weights are
real copies made per call (forward, and the recompute of gradient checkpointing), so a swap that
used a stale, missing or wrong block would change the numbers.
"""

from __future__ import annotations

import pytest
import torch

from stages.core import blockswap, fastpath, lora


def _tiny_flux(num_layers: int = 2, num_single_layers: int = 3) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=num_layers,
                                   num_single_layers=num_single_layers, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=24,
                                   guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    model.requires_grad_(False)
    lora.attach_lora(model, lora.lora_config(4, 4.0, 0.0, ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]))
    return model


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    h = w = 4  # packed latent tokens: 4x4
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(h).float(), torch.arange(w).float(), indexing="ij"), -1).reshape(-1, 3)
    return {"hidden_states": torch.randn(2, h * w, 16, generator=g), "encoder_hidden_states": torch.randn(2, 5, 32, generator=g),
            "pooled_projections": torch.randn(2, 24, generator=g), "timestep": torch.tensor([0.3, 0.8]),
            "guidance": torch.tensor([1.0, 1.0]), "img_ids": ids, "txt_ids": torch.zeros(5, 3)}


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**_inputs(), return_dict=False)[0]
    loss = (out.float() ** 2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointing", ["all", "keep_attention", ""])
@pytest.mark.parametrize("n_swapped, layout", [(1, "last"), (5, "last"), (3, "spread")])
def test_swapped_loss_and_lora_grads_equal_unswapped_bit_for_bit(checkpointing: str, n_swapped: int, layout: str) -> None:
    """"spread" with 3 of the 5 blocks swaps double block 0 and single blocks 2 and 4, resident ones
    between them: the slots (sized for the double block) serve both kinds. With runtime.keep_attention the
    resident blocks keep their attention outputs and the swapped ones are checkpointed as without it."""
    model = _tiny_flux()
    if checkpointing:
        model.enable_gradient_checkpointing(fastpath.checkpoint_function(0.0, keep_attention=checkpointing == "keep_attention"))
    model.train()
    loss_ref, grads_ref = _loss_and_grads(model)
    blocks = blockswap.repeated_blocks(model)
    swap = blockswap.install_block_swap(model, n_swapped, torch.device("cpu"), layout)
    assert swap is not None and len(swap.blocks) == n_swapped
    assert swap.blocks == [blocks[i] for i in ([0, 2, 4] if layout == "spread" else range(5 - n_swapped, 5))]
    loss, grads = _loss_and_grads(model)
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys() and len(grads) > 0
    for name in grads:
        assert torch.equal(grads[name], grads_ref[name]), name
    # forward fetches each swapped block once; the recompute of checkpointing fetches it again, except
    # its first two blocks, the forward's last two, still in the two slots
    assert swap.copies == (2 * n_swapped - min(n_swapped, 2) if checkpointing else n_swapped)
    assert swap.still_in_slot == (min(n_swapped, 2) if checkpointing else 0)
    # checkpointed calls run from the two reused slots, the next block copied ahead (5 blocks: each slot
    # is refilled while the math above stays exact); a call whose backward needs its weights later
    # (no checkpointing) gets copies of its own and prefetches nothing
    assert swap.prefetch_hits == (2 * (n_swapped - 1) if checkpointing else 0)


def test_a_block_still_in_its_slot_is_not_copied_again_and_the_math_stays_exact() -> None:
    """Steps with a no-grad forward between them (a validation pass leaves other blocks in the slots):
    each fetch that skips its copy must find exactly its block in the slot, or the loss changes."""
    model = _tiny_flux()
    model.enable_gradient_checkpointing(fastpath.checkpoint_function(0.0))
    model.train()
    loss_ref, grads_ref = _loss_and_grads(model)
    with torch.no_grad():
        out_ref = model(**_inputs(), return_dict=False)[0]
    swap = blockswap.install_block_swap(model, 5, torch.device("cpu"))
    copies = []
    for step in range(2):
        loss, grads = _loss_and_grads(model)
        assert torch.equal(loss, loss_ref) and all(torch.equal(grads[n], grads_ref[n]) for n in grads_ref)
        copies.append(swap.copies)
        if step == 0:
            with torch.no_grad():
                assert torch.equal(model(**_inputs(), return_dict=False)[0], out_ref)
            copies.append(swap.copies)
    # step 1: 8 (the recompute's first two blocks are in the slots); the no-grad forward: 3 (its first
    # two, 0 and 1, are where the recompute left them); step 2: 8 (the slots hold blocks 4 and 3 now)
    assert copies == [8, 11, 19] and swap.still_in_slot == 6
    assert swap.summary()["still_in_slot"] == 6


def test_after_a_graph_captured_copies_every_fetch_copies() -> None:
    """A CUDA graph's replays refill the slots without Python seeing it, so once one has captured the
    swap's copies (`_captured`, set at a fetch inside a capture), no fetch trusts what it last copied."""
    model = _tiny_flux()
    model.enable_gradient_checkpointing(fastpath.checkpoint_function(0.0))
    swap = blockswap.install_block_swap(model, 5, torch.device("cpu"))
    _loss_and_grads(model)
    assert swap.copies == 8  # two found in their slots
    swap._captured = True
    before = swap.copies, swap.still_in_slot
    _loss_and_grads(model)
    assert (swap.copies - before[0], swap.still_in_slot - before[1]) == (10, 0)


def test_a_failed_graph_capture_leaves_the_swap_copying_afresh() -> None:
    """A capture that ran the swapped forward and backward and then failed: what it says the slots hold
    (inside a real capture the copies are not done) and any copy it left pending are forgotten, so the
    eager call that follows copies its first blocks again; the loss stays exact."""
    model = _tiny_flux()
    model.enable_gradient_checkpointing(fastpath.checkpoint_function(0.0))
    loss_ref, _ = _loss_and_grads(model)
    swap = blockswap.install_block_swap(model, 5, torch.device("cpu"))
    lora_params = [p for p in model.parameters() if p.requires_grad]

    def broken(fn, sample_args, pool):  # as make_graphed_callables: forward, then backward, then it fails
        out = fn(*sample_args)[0]
        torch.autograd.grad((out.float() ** 2).mean(), lora_params)
        raise RuntimeError("capturing stream has unjoined work")

    events = []
    log = type("Log", (), {"emit": lambda self, event, **f: events.append((event, f))})()
    graphed = fastpath.GraphedDenoiser(model, lora_params, log, capture=broken)
    copies = []
    for _ in range(3):
        before = swap.copies
        model.zero_grad(set_to_none=True)
        loss = (graphed(**_inputs(), return_dict=False)[0].float() ** 2).mean()
        loss.backward()
        assert torch.equal(loss.detach(), loss_ref)
        copies.append(swap.copies - before)
    # the second call: the capture's 6 (blocks 0 and 1 found in the slots the step before left them
    # in, 4 and 3 in the recompute), then the eager call's 8, which copies 0 and 1 again (forgotten)
    assert copies == [8, 6 + 8, 6]
    assert graphed.summary()["failed"] == 1 and [e for e, _ in events] == ["warning"]


def test_swapped_blocks_run_from_two_slots_and_match_without_gradients() -> None:
    model = _tiny_flux()
    with torch.no_grad():
        ref = model(**_inputs(), return_dict=False)[0]
    swap = blockswap.install_block_swap(model, 5, torch.device("cpu"))
    assert len(swap.slots) == 2
    largest = max(blockswap.frozen_bytes(b) for b in swap.blocks)
    assert all(largest <= s.numel() < largest + 256 * 64 for s in swap.slots)  # the largest block, aligned
    for k, views in enumerate(swap._views):  # block k runs from slot k % 2: views made once, no copies per call
        slot = swap.slots[k % 2].untyped_storage().data_ptr()
        assert all(v.untyped_storage().data_ptr() == slot for v in views.values())
    for k, block in enumerate(swap.blocks):  # the host weights: views of one packed buffer per block
        packed = swap._flat[k].untyped_storage().data_ptr()
        assert all(p.untyped_storage().data_ptr() == packed for p in swap.host[id(block)].values())
    with torch.no_grad():
        out = model(**_inputs(), return_dict=False)[0]
    assert torch.equal(out, ref) and swap.copies == 5 and swap.prefetch_hits == 4


def test_released_slots_hold_no_memory_and_once_restored_the_blocks_run_as_before() -> None:
    """sample's offloaded pipeline gives the slots' memory to the text encoder or VAE that runs between the
    denoiser's calls: released, each slot's storage holds 0 bytes (its views stay); restored, every block is
    copied anew (what the slots held is gone) and the output is the same."""
    model = _tiny_flux()
    with torch.no_grad():
        ref = model(**_inputs(), return_dict=False)[0]
    swap = blockswap.install_block_swap(model, 5, torch.device("cpu"))
    with torch.no_grad():
        model(**_inputs(), return_dict=False)
    size = [s.numel() for s in swap.slots]
    swap.release_slots()
    assert [s.untyped_storage().nbytes() for s in swap.slots] == [0, 0]
    swap.restore_slots()
    assert [s.untyped_storage().nbytes() for s in swap.slots] == size
    for slot in swap.slots:
        slot.fill_(0xFF)  # what a reused allocation might hold: nothing of it may reach a block
    copies = swap.copies
    with torch.no_grad():
        out = model(**_inputs(), return_dict=False)[0]
    assert torch.equal(out, ref) and swap.copies == copies + 5


def test_swap_takes_the_last_blocks_and_keeps_names_and_lora_trainable() -> None:
    model = _tiny_flux()
    names_before = [n for n, _ in model.named_parameters()]
    swap = blockswap.install_block_swap(model, 2, torch.device("cpu"))
    assert [n for n, _ in model.named_parameters()] == names_before  # adapter save/export keys unchanged
    singles = list(model.single_transformer_blocks._modules.values())
    assert swap.blocks == singles[-2:]
    assert all(not p.requires_grad for params in swap.host.values() for p in params.values())
    assert any(p.requires_grad for b in swap.blocks for p in b.parameters())  # LoRA A/B stay the block's own
    assert isinstance(model.single_transformer_blocks, blockswap.SwappedModuleList)
    assert not isinstance(model.transformer_blocks, blockswap.SwappedModuleList)


def test_nothing_to_swap_returns_none() -> None:
    assert blockswap.install_block_swap(_tiny_flux(), 0, torch.device("cpu")) is None
    assert blockswap.install_block_swap(torch.nn.Linear(2, 2), 3, torch.device("cpu")) is None


@pytest.mark.parametrize("block_mb, n", [(162.2, 36), (680.0, 56), (3.0, 70), (1200.0, 3)])
def test_host_chunks_keep_pinned_rounding_small(block_mb: float, n: int) -> None:
    """torch's pinned allocator rounds each allocation up to a power of two; swapped blocks share
    chunks so the pinned total stays near their bytes (one 162 MB Qwen-Image nf4 block alone pins
    256 MB, 1.58x), every block lies inside one chunk and no two overlap."""
    sizes = [int(block_mb * 2**20) + k * 512 for k in range(n)]  # slightly different sizes, as SDXL's blocks
    chunks, where = blockswap.host_chunks(sizes)
    pinned = sum(1 << (c - 1).bit_length() for c in chunks)
    per_block = sum(1 << (size - 1).bit_length() for size in sizes)  # one pinned allocation per block
    assert pinned <= 1.25 * sum(sizes) and pinned < per_block
    spans = sorted((c, at, at + size) for (c, at), size in zip(where, sizes))
    assert all(end <= chunks[c] for c, _, end in spans)
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:]))
    assert sum(chunks) == sum(sizes)


def test_swapped_positions_last_and_spread() -> None:
    """Which blocks a plan that swaps k of n keeps in host memory: "last", the last k; "spread", k
    evenly spaced, the last block among them (the recompute starts with it); an unknown layout is an
    error naming the known ones."""
    assert blockswap.swapped_positions(10, 3) == [7, 8, 9] and blockswap.swapped_positions(10, 0, "spread") == []
    assert blockswap.swapped_positions(10, 5, "spread") == [1, 3, 5, 7, 9]
    assert blockswap.swapped_positions(60, 27, "spread")[-1] == 59 and blockswap.swapped_positions(5, 9, "spread") == [0, 1, 2, 3, 4]
    for n in (5, 57, 60):
        for k in range(1, n + 1):
            spread = blockswap.swapped_positions(n, k, "spread")
            gaps = {b - a for a, b in zip(spread, spread[1:])}
            assert len(spread) == k == len(set(spread)) and spread[-1] == n - 1 and spread == sorted(spread)
            assert max(gaps, default=0) - min(gaps, default=0) <= 1 and min(spread) == n // k - 1  # evenly spaced
    with pytest.raises(ValueError, match="'middle' is not one of last, spread"):
        blockswap.swapped_positions(5, 2, "middle")


@pytest.mark.parametrize("layout", ["last", "spread"])
def test_the_nf4_load_puts_in_host_memory_the_blocks_the_swap_takes(layout: str) -> None:
    """nf4_blocks quantizes block by block and leaves in host memory the blocks block swap will swap:
    both ask blockswap.swapped_positions, so a spread plan's resident blocks never start on the host."""
    from stages.core import nf4_blocks

    model = _tiny_flux()
    blocks = blockswap.repeated_blocks(model)
    host = [mods[0] for mods, to_host in nf4_blocks._groups(model, 3, layout) if to_host]
    assert host == [blocks[i] for i in ([0, 2, 4] if layout == "spread" else [2, 3, 4])]
    swap = blockswap.install_block_swap(model, 3, torch.device("cpu"), layout)
    assert swap is not None and swap.blocks == host
