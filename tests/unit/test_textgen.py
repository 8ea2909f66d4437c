"""The engine model's tokenizer and token generator: round trip, continuation, hashes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream_scheduler.textgen import (
    BOS_ID,
    EOS_ID,
    TextGenConfig,
    TokenGenerator,
    Tokenizer,
    UnknownTokenError,
    block_hashes,
    render_chat,
)

pytestmark = pytest.mark.unit

TOK = Tokenizer()
GEN = TokenGenerator(TOK, TextGenConfig(mean_output_tokens=20.0))


def generate(seed: int, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], bool]:
    """Generate like the engine server: returns (non-EOS tokens, stopped on EOS)."""
    ctx = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_tokens):
        if GEN.is_eos(seed, ctx):
            return out, True
        tok = GEN.next_token(seed, ctx)
        ctx.append(tok)
        out.append(tok)
    return out, False


texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200) | st.lists(
    st.sampled_from(["the", " model", "\n", "  ", "über", "🙂", "x,", "\t"])
).map("".join)


@given(texts)
def test_round_trip_is_exact(text: str) -> None:
    assert TOK.decode(TOK.encode(text)) == text


@given(texts)
def test_bos_is_prepended_and_skippable(text: str) -> None:
    ids = TOK.encode(text, add_bos=True)
    assert ids[0] == BOS_ID
    assert TOK.decode(ids, skip_special=True) == text
    assert TOK.decode(ids) == "<s>" + text


@settings(max_examples=60)
@given(texts, st.integers(0, 2**63 - 1), st.integers(1, 40))
def test_concatenation_at_generated_boundary(prefix: str, seed: int, n: int) -> None:
    generated, _ = generate(seed, TOK.encode(prefix), n)
    text = TOK.decode(generated)
    assert TOK.encode(prefix + text) == TOK.encode(prefix) + generated
    assert TOK.encode(text) == generated


@settings(max_examples=60)
@given(texts, st.integers(0, 2**32), st.integers(2, 80), st.data())
def test_continuation_produces_the_same_text(
    prompt: str, seed: int, max_tokens: int, data: st.DataObject
) -> None:
    """Preempt after `cut` tokens, resume with prompt + text so far: same output."""
    full, full_eos = generate(seed, TOK.encode(prompt, add_bos=True), max_tokens)
    cut = data.draw(st.integers(0, len(full)))
    head_text = TOK.decode(full[:cut])
    resumed_prompt = TOK.encode(prompt + head_text, add_bos=True)
    tail, tail_eos = generate(seed, resumed_prompt, max_tokens - cut)
    assert head_text + TOK.decode(tail) == TOK.decode(full)
    assert tail_eos == full_eos


def test_generation_is_deterministic_and_seed_dependent() -> None:
    prompt = TOK.encode("Tell me about the river", add_bos=True)
    a, _ = generate(7, prompt, 30)
    b, _ = generate(7, prompt, 30)
    c, _ = generate(8, prompt, 30)
    assert a == b
    assert a != c


def test_geometric_stopping_has_the_configured_mean() -> None:
    lengths = []
    for seed in range(400):
        out, eos = generate(seed, TOK.encode(f"prompt {seed}"), 10_000)
        assert eos
        lengths.append(len(out) + 1)  # the EOS token counts as generated
    mean = sum(lengths) / len(lengths)
    assert 16.0 < mean < 24.0  # configured mean 20; 400 samples, sd of mean ~1


def test_generated_tokens_are_space_prefixed_words() -> None:
    out, _ = generate(3, [BOS_ID], 50)
    for tok in out:
        piece = TOK.piece(tok)
        assert piece.startswith(" ")
        assert not piece[1:].isspace()
        assert " " not in piece[1:]
    assert EOS_ID not in out


def test_unknown_token_id_raises() -> None:
    with pytest.raises(UnknownTokenError) as err:
        TOK.decode([40_000])
    assert err.value.token_id == 40_000
    assert not TOK.is_valid(40_000)
    assert not TOK.is_valid(-1)
    assert TOK.is_valid(BOS_ID)
    assert TOK.decode([10, 15043]) == "<unused10><unused15043>"  # Llama-2 ids are accepted


def test_known_words_are_single_tokens() -> None:
    assert len(TOK.encode("the model")) == 2
    assert len(TOK.encode("Supercalifragilistic")) == 7  # 20 bytes in 3-byte chunks


def test_block_hashes_share_exactly_the_common_prefix() -> None:
    a = list(range(100, 164))  # 4 blocks
    b = a[:40] + [7] * 24  # differs inside block 2
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == 4
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2]
    assert ha[3] != hb[3]  # chained: a later equal block still differs
    assert block_hashes(a[:15]) == ()
    assert block_hashes(a[:33]) == ha[:2]


def test_block_hashes_depend_on_position() -> None:
    block = [5] * 16
    h = block_hashes(block * 2)
    assert h[0] != h[1]


def test_chat_template_continuation_is_a_suffix() -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    base = render_chat(msgs)
    assert base.endswith("<|assistant|>\n")
    partial = " the model"
    cont = render_chat(
        [*msgs, {"role": "assistant", "content": partial}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert cont == base + partial
    assert TOK.encode(cont) == TOK.encode(base) + TOK.encode(partial)
    assert not render_chat(msgs, add_generation_prompt=False).endswith("<|assistant|>\n")
