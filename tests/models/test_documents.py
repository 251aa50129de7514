"""Documents packed into one block stay separate (`position_ids` restarting at 0, as transformers' padding-free
collators mark them): no output of a document reads another's inputs, a packed block computes what each document
alone computes, and the recurrent, chunked and reference paths restart at the same boundaries."""

import pytest
import torch

from s4accel import MoEConfig, MoEForCausalLM, S4Config, S4ForCausalLM
from s4accel.models.documents import Documents

LENGTHS = [7, 20, 5, 32]  # four documents in one 64-position block; A = the first, B = the second
VOCAB = 50


def model(variant: str, dtype=torch.float32):
    torch.manual_seed(0)
    if variant.startswith("moe"):
        config = MoEConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, d_ffn=64, num_experts=4,
                           use_moe=variant == "moe")
        return MoEForCausalLM(config).to(dtype).eval()
    kernel, _, ffn = variant.partition("+")
    config = S4Config(vocab_size=VOCAB, d_model=32, n_layer=2, d_state=16, kernel=kernel, l_max=64, dropout=0.0,
                      ffn=ffn or "none", **({"num_experts": 4, "d_ffn": 32} if ffn == "moe" else {}))
    return S4ForCausalLM(config).to(dtype).eval()


def packed(lengths=LENGTHS, rows=1, seed=1):
    torch.manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(rows, -1)
    return ids, positions


# The S4 kernels and the dense transformer's attention: bit for bit (with experts: below).
EXACT = ["s4d", "s4", "moe-dense"]


@pytest.mark.parametrize("variant", EXACT)
def test_changing_the_last_token_of_a_document_leaves_every_logit_of_the_next_bit_identical(variant):
    m = model(variant)
    ids, positions = packed()
    a_end = LENGTHS[0] - 1
    other = ids.clone()
    other[0, a_end] = (other[0, a_end] + 1) % VOCAB
    logits, changed = (m(input_ids=x, position_ids=positions).logits for x in (ids, other))
    assert not torch.equal(logits[0, : a_end + 1], changed[0, : a_end + 1])  # A itself does change
    assert torch.equal(logits[0, a_end + 1:], changed[0, a_end + 1:])  # B and every later document: not one bit
    plain, plain_changed = (m(input_ids=x).logits for x in (ids, other))
    assert not torch.equal(plain[0, a_end + 1:], plain_changed[0, a_end + 1:])  # read as one text, B sees A


@pytest.mark.parametrize("dispatch", ["fused", "grouped_mm", "grouped_mm, compiled routing",
                                      "grouped_mm, compiled experts"])
@pytest.mark.parametrize("variant", ["moe", "s4d+moe"])
def test_with_experts_too_changing_one_document_leaves_the_next_bit_identical(variant, dispatch, monkeypatch):
    """Which tokens share an expert's matmul depends on every token's routing, and a BLAS rounds a row differently
    with the row count of its product: the expert slices are padded to whole tiles of rows so that it never matters.
    Wide enough layers (here 256 x 512, 8 experts) to take the kernels whose rounding depends on the row count.
    `grouped_mm` is the GPU's dispatch (static row layout), run here on the CPU's grouped_mm; with its routing
    compiled, as eager layers can run it on a GPU (`moe.COMPILE_ROUTING`), and with its routing and experts compiled
    together (`moe.COMPILE_EXPERTS`)."""
    from torch._dynamo.utils import counters

    from s4accel.models import moe

    if dispatch.endswith("compiled routing"):
        monkeypatch.setattr(moe, "COMPILE_ROUTING", "always")
        monkeypatch.setattr(moe, "_ROUTING_FAILED", [])
        dispatch = "grouped_mm"
    compiled_experts = dispatch.endswith("compiled experts")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=compiled_experts)
    if compiled_experts:  # in bf16, where they compile (moe.grouped_mm_traceable)
        monkeypatch.setattr(moe, "COMPILE_EXPERTS", "always")
        monkeypatch.setattr(moe, "_EXPERTS_FAILED", [])
        torch._dynamo.reset()
        counters.clear()
        dispatch = "grouped_mm"
    torch.manual_seed(0)
    wide = dict(vocab_size=VOCAB, d_model=256, n_layer=2, d_ffn=512, num_experts=8, moe_dispatch=dispatch)
    m = (MoEForCausalLM(MoEConfig(n_head=4, **wide)) if variant == "moe" else
         S4ForCausalLM(S4Config(d_state=16, kernel="s4d", l_max=64, dropout=0.0, ffn="moe", **wide))).eval()
    ids, positions = packed(rows=4)
    a_end = LENGTHS[0] - 1
    with torch.no_grad(), autocast:
        logits = m(input_ids=ids, position_ids=positions).logits
        for delta in range(1, 6):  # several changes of A's last token, each routed its own way
            other = ids.clone()
            other[:, a_end] = (other[:, a_end] + delta) % VOCAB
            changed = m(input_ids=other, position_ids=positions).logits
            assert not torch.equal(logits[:, a_end], changed[:, a_end])
            assert torch.equal(logits[:, a_end + 1:], changed[:, a_end + 1:]), delta
    assert not moe._ROUTING_FAILED and not moe._EXPERTS_FAILED  # where compiled, compiled indeed
    assert not compiled_experts or counters["stats"]["unique_graphs"] >= 1


@pytest.mark.parametrize("variant", [*EXACT, "moe", "s4d+moe"])
def test_a_packed_block_gives_each_documents_own_logits_and_gradients(variant):
    m = model(variant)
    ids, positions = packed()
    torch.manual_seed(2)
    weights = torch.randn(1, ids.shape[1], VOCAB)  # an arbitrary loss over every logit

    logits = m(input_ids=ids, position_ids=positions).logits
    (logits * weights).sum().backward()
    grads_packed = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()

    alone, start = [], 0
    for n in LENGTHS:
        out = m(input_ids=ids[:, start:start + n]).logits
        (out * weights[:, start:start + n]).sum().backward()
        alone.append(out)
        start += n
    assert torch.allclose(logits, torch.cat(alone, 1), atol=1e-5, rtol=0)
    for name, p in m.named_parameters():  # within 1e-5 of the gradient's scale (its entries reach ~20 here)
        if p.grad is not None:
            assert (grads_packed[name] - p.grad).abs().max() <= 1e-5 * p.grad.abs().max(), name


@pytest.mark.parametrize("kernel", ["s4d", "s4"])
def test_recurrent_and_chunked_reading_restart_at_the_same_boundaries_as_the_convolution(kernel):
    m = model(kernel, torch.float64)
    ids = torch.randint(3, VOCAB, (2, 40))
    # row 0: three documents; row 1: a document that began before the block (its ids count from 1), then another
    positions = torch.stack([torch.cat([torch.arange(n) for n in (7, 20, 13)]),
                             torch.cat([torch.arange(1, 11), torch.arange(30)])])
    whole = m(input_ids=ids, position_ids=positions).logits
    assert not torch.allclose(whole, m(input_ids=ids).logits, atol=1e-6)  # the boundaries do change what is read

    out = m(input_ids=ids[:, :1], position_ids=positions[:, :1], use_cache=True)
    steps = [out.logits]
    for t in range(1, ids.shape[1]):  # one token at a time: the recurrent step, reset where a document starts
        out = m(input_ids=ids[:, t:t + 1], position_ids=positions[:, t:t + 1], cache=out.cache, use_cache=True)
        steps.append(out.logits)
    assert torch.allclose(torch.cat(steps, 1), whole, atol=1e-10, rtol=0)

    first = m(input_ids=ids[:, :15], position_ids=positions[:, :15], use_cache=True)
    rest = m(input_ids=ids[:, 15:], position_ids=positions[:, 15:], cache=first.cache, use_cache=True)
    assert torch.allclose(torch.cat([first.logits, rest.logits], 1), whole, atol=1e-10, rtol=0)


@pytest.mark.parametrize("kernel", ["s4d", "s4"])
def test_the_layer_on_documents_equals_the_reference_recurrence_reset_at_each_start(kernel):
    """float64: the bucketed convolution, the state carried into a row's continued first document and the state
    after its last one, against the SSM run one step at a time with its state zeroed where a document starts."""
    m = model(kernel, torch.float64)
    layer = m.backbone.layers[0].layer
    positions = torch.stack([torch.cat([torch.arange(n) for n in (7, 20, 13)]),
                             torch.cat([torch.arange(1, 11), torch.arange(30)])])
    u = torch.randn(2, 40, 32, dtype=torch.float64)
    zero = layer.kernel.zero_state(2, u)
    state = torch.complex(torch.randn(zero.shape, dtype=torch.float64), torch.randn(zero.shape, dtype=torch.float64))
    y, new_state = layer(u, state, True, Documents(positions))
    ref, ref_state = layer.kernel.recurrence(u.transpose(1, 2), state, positions == 0)
    ref = layer._mix((ref + u.transpose(1, 2) * layer.D[:, None]).transpose(1, 2))
    assert torch.allclose(y, ref, atol=1e-10, rtol=0)
    assert torch.allclose(new_state, ref_state, atol=1e-10, rtol=0)


def test_documents_of_any_length_fall_in_buckets_that_cover_them():
    lengths = [1, 2, 15, 16, 17, 40, 1]
    docs = Documents(torch.cat([torch.arange(n) for n in lengths])[None])
    assert [b for b, _ in docs.groups] == [16, 24, 48]  # a half-octave grid in multiples of 8
    covered = torch.cat([index[index < sum(lengths)] for _, index in docs.groups])
    assert sorted(covered.tolist()) == list(range(sum(lengths)))  # every position in exactly one document row
    assert Documents.of(torch.arange(10)[None]) is None  # one document per row: nothing to split


@pytest.mark.parametrize("variant", ["s4d", "s4", "moe"])
def test_generate_after_a_packed_prompt_continues_its_last_document_alone(variant):
    """position_ids handed to `generate()` (which extends them while decoding): the recurrent state or the key/value
    cache of the earlier documents never reaches the continuation."""
    m = model(variant)
    m.generation_config.pad_token_id = 0
    torch.manual_seed(3)
    a, b = torch.randint(3, VOCAB, (1, 9)), torch.randint(3, VOCAB, (1, 6))
    prompt = torch.cat([a, b], 1)
    positions = torch.cat([torch.arange(9), torch.arange(6)])[None]
    kw = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    packed_out, alone = m.generate(prompt, position_ids=positions, **kw), m.generate(b, **kw)
    assert torch.equal(packed_out.sequences[:, -5:], alone.sequences[:, -5:])
    for x, y in zip(packed_out.scores, alone.scores):
        assert torch.allclose(x, y, atol=1e-5, rtol=0)
    together = m.generate(prompt, **kw)  # read as one text, the continuation differs
    assert not all(torch.allclose(x, y, atol=1e-4) for x, y in zip(together.scores, alone.scores))
