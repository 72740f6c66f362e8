"""The CPU KDA core under MTP verification: resuming from the accepted draft's state slot gives exactly what
plain token-by-token decoding gives, whether the draft was accepted or rejected. And its in-prefill checkpoints:
the state a prefill leaves at an offset inside its pass, as a prefill of that many tokens would."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ling.kda_core import _no_checkpoint_writer, run_torch

H, D_HEAD, K_CONV, NUM_SPEC = 2, 8, 4, 1
CH = 3 * H * D_HEAD  # q, k, v channels through the short conv
A, B, PLAIN = 1, 2, 3  # cache slots (0 is vLLM's null block)


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, CH, generator=gen)
    g = -torch.rand(n, H, D_HEAD, generator=gen) * 2  # log-decay in [-2, 0]
    beta = torch.rand(n, H, generator=gen)
    return qkv, g, beta


class Cache:
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.conv_w = torch.randn(CH, K_CONV, generator=gen) * 0.5
        self.conv = torch.zeros(4, CH, K_CONV - 1 + NUM_SPEC)
        self.rec = torch.zeros(4, H, D_HEAD, D_HEAD)

    def plain(self, qkv, g, beta, slot: int, first: bool = False) -> torch.Tensor:
        """Prefill (first) or one-token decode steps of one sequence, the non-spec path."""
        outs = []
        steps = [(qkv, g, beta)] if first else [(qkv[i : i + 1], g[i : i + 1], beta[i : i + 1]) for i in range(len(qkv))]
        for x, gg, bb in steps:
            meta = SimpleNamespace(
                spec_sequence_masks=None, num_prefills=int(first), num_decodes=int(not first),
                non_spec_query_start_loc=torch.tensor([0, len(x)]), non_spec_state_indices_tensor=torch.tensor([slot]),
                has_initial_state=torch.tensor([not first]))
            outs.append(run_torch(x, gg, bb, self.conv_w, self.conv, self.rec, meta, D_HEAD))
        return torch.cat(outs)

    def verify(self, qkv, g, beta, accepted: int) -> torch.Tensor:
        """One MTP verification step (last token + NUM_SPEC drafts) of one sequence with slots [A, B]."""
        meta = SimpleNamespace(
            spec_sequence_masks=torch.tensor([True]), num_prefills=0, num_decodes=0, num_spec_decodes=1,
            spec_state_indices_tensor=torch.tensor([[A, B]]), spec_query_start_loc=torch.tensor([0, len(qkv)]),
            num_accepted_tokens=torch.tensor([accepted]))
        return run_torch(qkv, g, beta, self.conv_w, self.conv, self.rec, meta, D_HEAD)


def _reference(*chunks) -> torch.Tensor:
    """Plain decoding of the accepted tokens, one at a time, after the same prefill."""
    ref = Cache()
    prompt = chunks[0]
    ref.plain(*prompt, slot=PLAIN, first=True)
    return torch.cat([ref.plain(*c, slot=PLAIN) for c in chunks[1:]]) if len(chunks) > 1 else torch.empty(0)


def _cat(*parts):
    return tuple(torch.cat(x) for x in zip(*parts))


def _sub(t, i, j):
    return tuple(x[i:j] for x in t)


def test_verify_after_accepted_draft_matches_plain_decoding():
    prompt, step1, step2 = _tokens(7, 1), _tokens(2, 2), _tokens(2, 3)
    cache = Cache()
    cache.plain(*prompt, slot=A, first=True)
    out1 = cache.verify(*step1, accepted=1)  # first verify after prefill
    out2 = cache.verify(*step2, accepted=2)  # the draft of step 1 was accepted: resume after it
    ref = _reference(prompt, step1, step2)
    torch.testing.assert_close(torch.cat([out1, out2]), ref, rtol=1e-5, atol=1e-5)


def test_verify_after_rejected_draft_resumes_from_the_last_accepted_token():
    prompt, step1, step2 = _tokens(7, 1), _tokens(2, 2), _tokens(2, 4)
    cache = Cache()
    cache.plain(*prompt, slot=A, first=True)
    out1 = cache.verify(*step1, accepted=1)
    out2 = cache.verify(*step2, accepted=1)  # step 1's draft rejected: its token never happened
    ref = _reference(prompt, _sub(step1, 0, 1), step2)
    torch.testing.assert_close(torch.cat([out1[:1], out2]), ref, rtol=1e-5, atol=1e-5)


def test_resuming_from_the_wrong_slot_is_caught():
    """The comparison can fail: claiming the rejected draft was accepted gives other outputs."""
    prompt, step1, step2 = _tokens(7, 1), _tokens(2, 2), _tokens(2, 4)
    cache = Cache()
    cache.plain(*prompt, slot=A, first=True)
    cache.verify(*step1, accepted=1)
    wrong = cache.verify(*step2, accepted=2)
    ref = _reference(prompt, _sub(step1, 0, 1), step2)
    assert (wrong - ref[-2:]).abs().max() > 1e-2


def test_null_block_padding_rows_are_zero_and_write_nothing():
    cache = Cache()
    qkv, g, beta = _tokens(2, 5)
    before_conv, before_rec = cache.conv.clone(), cache.rec.clone()
    meta = SimpleNamespace(
        spec_sequence_masks=torch.tensor([True]), num_prefills=0, num_decodes=0, num_spec_decodes=1,
        spec_state_indices_tensor=torch.tensor([[0, 0]]), spec_query_start_loc=torch.tensor([0, 2]),
        num_accepted_tokens=torch.tensor([1]))
    out = run_torch(qkv, g, beta, cache.conv_w, cache.conv, cache.rec, meta, D_HEAD)
    assert out.abs().max() == 0
    assert torch.equal(cache.conv, before_conv) and torch.equal(cache.rec, before_rec)


def test_heads_are_dense_as_the_fla_kernels_index_them():
    """q, k, v go to vLLM's FLA kernels, which index [T, H, d] as contiguous: strided chunks of the conv output
    made every sequence but the first in an H200 verify batch read another token's channels (FINDINGS.md §1)."""
    from vllm_ling.kda_core import _heads

    qkvb = torch.randn(5, CH + H)  # the model's fused q|k|v|β projection; q|k|v is its strided first part
    heads = _heads(qkvb[:, :CH], D_HEAD)
    for t, part in zip(heads, qkvb[:, :CH].chunk(3, dim=-1)):
        assert t.is_contiguous() and t.shape == (1, 5, H, D_HEAD)
        assert torch.equal(t.reshape(5, -1), part)
    # one copy for all three (a kernel per verify or prefill step saved twice over), none for a single token
    assert len({t.untyped_storage().data_ptr() for t in heads}) == 1
    assert heads[0].untyped_storage().data_ptr() != qkvb.untyped_storage().data_ptr()
    one = qkvb[:1, :CH]
    assert all(t.is_contiguous() and t.untyped_storage().data_ptr() == qkvb.untyped_storage().data_ptr()
               for t in _heads(one, D_HEAD))


def test_a_state_not_dense_per_slot_takes_our_gate_and_says_so(monkeypatch, caplog):
    """vLLM's raw-gate kernels need each slot's state dense [H, V, K]; a padded state page takes run_cuda with
    our gate (the law the kernels apply), and one warning line says so (the self-check reads it)."""
    from vllm_ling import kda_core
    from vllm_ling.ops.kda import kda_safe_gate

    seen = {}
    monkeypatch.setattr(kda_core, "run_cuda", lambda qkv, g, beta, *rest: seen.update(g=g, beta=beta) or "ran")
    padded = torch.zeros(4, H, D_HEAD, D_HEAD + 4)[..., :D_HEAD]  # per-slot rows padded: stride 12, not 8
    assert not kda_core.dense_slots(padded) and kda_core.dense_slots(torch.zeros(4, H, D_HEAD, D_HEAD))
    gen = torch.Generator().manual_seed(1)
    f, b = torch.randn(3, H * D_HEAD, generator=gen), torch.randn(3, H, generator=gen)
    gate = kda_core.Gate(torch.randn(H, generator=gen), torch.randn(H * D_HEAD, generator=gen), -5.0)
    kda_core._say_not_dense.cache_clear()
    with caplog.at_level("WARNING", logger="vllm_ling"):
        ran = kda_core.run_cuda_gate_in_kernel(torch.zeros(3, CH), f, b, gate, None, None, padded, None, D_HEAD)
    assert ran == "ran" and "KDA gate fell back to ours" in caplog.text and str(padded.stride()) in caplog.text
    torch.testing.assert_close(seen["g"], kda_safe_gate(f, gate.A_log, gate.dt_bias, -5.0), rtol=0, atol=0)
    torch.testing.assert_close(seen["beta"], torch.sigmoid(b), rtol=0, atol=0)


def _prefill_meta(lens: list[int], slots: list[int], resumed: list[bool], checkpoint=None) -> SimpleNamespace:
    return SimpleNamespace(
        spec_sequence_masks=None, num_prefills=len(lens), num_decodes=0,
        non_spec_query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]),
        non_spec_state_indices_tensor=torch.tensor(slots), has_initial_state=torch.tensor(resumed),
        checkpoint=checkpoint)


def test_an_in_prefill_checkpoint_holds_the_state_after_its_offset():
    """vLLM's in-prefill checkpoint (MambaPrefillCheckpointMetadata: per row an offset into its query, 0 for none,
    and the checkpoint block's slot): the slot then holds exactly what a prefill of the row's first `offset` tokens
    leaves, recurrent state and conv window, while the row's own slot holds the whole prefill's; a row without one
    (offset 0) and the null slot are left alone. Two rows: a resumed one and a fresh one."""
    (qa, ga, ba), (qb, gb, bb) = _tokens(40, seed=7), _tokens(37, seed=8)
    warm = _tokens(9, seed=9)
    cache, ref = Cache(), Cache()
    for c in (cache, ref):  # row A resumes from a state its slot holds
        c.plain(*warm, slot=A, first=True)
    ckpt = SimpleNamespace(checkpoint_offsets=torch.tensor([32, 0]), state_indices=torch.tensor([PLAIN, 0]))
    meta = _prefill_meta([40, 37], [A, B], [True, False], ckpt)
    null_before = cache.rec[0].clone(), cache.conv[0].clone()
    out = run_torch(torch.cat([qa, qb]), torch.cat([ga, gb]), torch.cat([ba, bb]), cache.conv_w, cache.conv,
                    cache.rec, meta, D_HEAD)
    # the reference: the same rows without a checkpoint, and row A's first 32 tokens alone from the same state
    ref_out = run_torch(torch.cat([qa, qb]), torch.cat([ga, gb]), torch.cat([ba, bb]), ref.conv_w, ref.conv.clone(),
                        ref.rec.clone(), _prefill_meta([40, 37], [A, B], [True, False]), D_HEAD)
    ref.plain(qa[:32], ga[:32], ba[:32], slot=A)  # token by token from A's state: the recurrent form, not chunked
    width = K_CONV - 1
    assert torch.allclose(out, ref_out, atol=1e-6)
    assert torch.allclose(cache.rec[PLAIN], ref.rec[A], atol=1e-5)
    assert torch.equal(cache.conv[PLAIN, :, :width], ref.conv[A, :, :width])
    assert torch.equal(cache.rec[0], null_before[0]) and torch.equal(cache.conv[0], null_before[1])
    # negative control: the state after 31 or 33 tokens is not the checkpoint's
    off = Cache()
    off.plain(*warm, slot=A, first=True)
    off.plain(qa[:33], ga[:33], ba[:33], slot=A)
    assert not torch.allclose(cache.rec[PLAIN], off.rec[A], atol=1e-5)


def test_a_kernel_that_cannot_write_a_checkpoint_refuses_one():
    """Triton chunk_kda writes no in-prefill checkpoint: handed one, the step fails loudly instead of leaving the
    checkpoint block's stale state to be served as a cached prefix (the layer never declares them there)."""
    _no_checkpoint_writer(SimpleNamespace(checkpoint=None), "Triton chunk_kda")
    _no_checkpoint_writer(SimpleNamespace(), "Triton chunk_kda")
    with pytest.raises(RuntimeError, match="reached Triton chunk_kda, which cannot write it.*CHECKPOINT=0"):
        _no_checkpoint_writer(SimpleNamespace(checkpoint=object()), "Triton chunk_kda")
