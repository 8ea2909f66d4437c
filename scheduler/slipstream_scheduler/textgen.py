"""A toy tokenizer and a deterministic token generator for the engine model.

The real-time engine server (``slipstream engine``) answers vLLM's HTTP API
without a model, so it needs text: a tokenizer for prompts and a generator for
output tokens. Both live here, pure and seeded, so the simulator and the tests
share them.

What the rest of Slipstream relies on (each is tested in ``tests/unit/test_textgen.py``):

* **Exact round trip.** ``decode(encode(text)) == text`` for any text (with
  ``add_bos=False``). A prompt is cut into *pieces* (an optional single space
  plus a run of non-whitespace characters, or one whitespace character); a
  piece in the fixed vocabulary is one token, any other piece is split into
  UTF-8 chunks of up to three bytes, each one token whose id packs the bytes.
* **Concatenation at generated-token boundaries.** Every generated token is a
  space followed by a word, so ``encode(a + b) == encode(a) + encode(b)``
  whenever ``b`` is generated text, whatever ``a`` is. A client that resumes a
  preempted request by re-sending ``prompt + text so far`` therefore sends the
  token sequence the engine had in its context.
* **Generation is a function of the context.** The next token is a pure
  function of ``(seed, the last k token ids)`` and the end-of-sequence decision
  of ``(seed, the last k token ids, the absolute position)``; stopping is
  geometric with a configurable mean. A resumed request (prompt + text so far,
  fewer ``max_tokens``) thus produces exactly the text the uninterrupted one
  would have.
* **Prefix-cache keys.** :func:`block_hashes` chains a hash over each full
  16-token block, so prompts sharing a prefix share leading block hashes.

Deliberately left out: any resemblance to a real language model (the text is
a stream of common English words), BPE merges, special-token parsing inside
prompt text, and logprobs. Errors::

    TextGenError
     +-- UnknownTokenError   (an id the tokenizer cannot decode)
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "ChatMessage",
    "TextGenConfig",
    "TextGenError",
    "TokenGenerator",
    "Tokenizer",
    "UnknownTokenError",
    "block_hashes",
    "render_chat",
]


class TextGenError(Exception):
    """Base of this module's errors."""


class UnknownTokenError(TextGenError):
    """A token id that is neither in the vocabulary nor a byte chunk."""

    def __init__(self, token_id: int) -> None:
        super().__init__(f"unknown token id {token_id}")
        self.token_id = token_id


# Words the generator draws from (each becomes the token " word"). Written for
# this module; any list of distinct whitespace-free strings works.
_WORDS_TEXT = """
    the of and to in is that for it as with was on be by this are at from or
    have an they which one you were all we can her has there been if more when
    will would who so no out up into do any about than them its only other new
    some could time these two may then first also after over where most made
    many before such through back years good much well even because each those
    people how state very long own under never same last world here still city
    while high small large next early young important public few local real
    best sure free full clear open short known whole major true able late hard
    strong special easy human local general social national final common simple
    river light water stone cloud forest garden window letter market number
    system program question problem example family country company service
    power order place point house group story field level change
    model token signal engine batch queue memory cache budget latency request
    prefix block graph vector kernel stream buffer packet server client cluster
    pod node shard job task trace window metric sample value price record
    answer result method theory course school paper report office table chair
    music color voice money night morning summer winter spring autumn island
    mountain valley ocean desert bridge road train plane ship wheel engine tower
    castle village street square park library museum theater hospital station
    doctor teacher student writer reader painter builder farmer sailor pilot
    friend neighbor stranger leader member partner player runner singer
    apple bread cheese honey lemon onion pepper salt sugar tea coffee rice
    simply rather quite almost always often seldom already again together
    soon later today tomorrow yesterday inside outside above below between
    around across along behind beyond within without toward upon among
    build carry draw drive eat fall fly give grow hold keep know learn leave
    make move pay play read ride run say see sell send show sing sit speak
    stand start stay swim take teach tell think throw turn walk want watch
    write bring catch choose follow forget happen improve measure notice
    observe prepare protect reach remember repeat return share solve travel
    bright calm careful cheap clean cold dark deep dry fair fast fresh gentle
    green heavy honest kind loud narrow old proud quiet rare rich rough safe
    sharp slow smooth soft sweet tall thin warm wide wild wise yellow blue red
"""
_GEN_WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORDS_TEXT.split()))  # distinct, in order

BOS_ID = 1
EOS_ID = 2
_SPECIALS: tuple[str, ...] = ("<unk>", "<s>", "</s>")
_FIRST_WORD_ID = 16
# Byte-chunk ids: CHUNK_BASE + ((n - 1) << 24 | big-endian n bytes), n in 1..3.
_CHUNK_BASE = 1 << 24
_CHUNK_MAX = _CHUNK_BASE + (3 << 24)
_PIECE_RE = re.compile(r" ?\S+|\s")

_MASK64 = (1 << 64) - 1
_EOS_SALT = 0x5EED_E05E_0F5E_0000
_SEED_SALT = 0x9E37_79B9_7F4A_7C15


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Tokenizer:
    """Word-piece tokenizer with a byte-chunk fallback (see the module docstring).

    Vocabulary: ids 0-2 are ``<unk>``, ``<s>`` (BOS) and ``</s>`` (EOS); from
    id 16 come the generator's words, each once with a leading space and once
    without, then single whitespace characters. Every other piece is encoded as
    byte chunks with ids at or above ``2**24``. The remaining ids below
    ``vocab_size`` (default 32000, Llama-2's) are valid but never produced by
    :meth:`encode`; they decode to ``<unusedN>`` so that any id a client takes
    from a real Llama-2 tokenizer is accepted.
    """

    def __init__(self, vocab_size: int = 32000) -> None:
        pieces: list[str] = []
        for word in _GEN_WORDS:
            pieces.append(" " + word)
        for word in _GEN_WORDS:
            pieces.append(word)
        pieces.extend([" ", "\n", "\t", "\r"])
        self._id_to_piece: dict[int, str] = {i: s for i, s in enumerate(_SPECIALS)}
        self._piece_to_id: dict[str, int] = {}
        for offset, piece in enumerate(pieces):
            token_id = _FIRST_WORD_ID + offset
            self._id_to_piece[token_id] = piece
            self._piece_to_id[piece] = token_id
        self.generation_ids: tuple[int, ...] = tuple(
            _FIRST_WORD_ID + i for i in range(len(_GEN_WORDS))
        )
        self.vocab_size = max(vocab_size, _FIRST_WORD_ID + len(pieces))

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_bos`` prepends ``<s>``."""
        out: list[int] = [BOS_ID] if add_bos else []
        lookup = self._piece_to_id.get
        for piece in _PIECE_RE.findall(text):
            token_id = lookup(piece)
            if token_id is not None:
                out.append(token_id)
            else:
                out.extend(_chunk_ids(piece.encode("utf-8")))
        return out

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ``ids``; byte chunks are joined before UTF-8 decoding.

        Raises :class:`UnknownTokenError` for an id outside the vocabulary.
        Incomplete UTF-8 sequences (a partial chunk run) decode with U+FFFD.
        """
        buf = bytearray()
        parts: list[str] = []
        for token_id in ids:
            if _CHUNK_BASE <= token_id < _CHUNK_MAX:
                buf += _chunk_bytes(token_id)
                continue
            piece = self._id_to_piece.get(token_id)
            if piece is None:
                if not 0 <= token_id < self.vocab_size:
                    raise UnknownTokenError(token_id)
                piece = f"<unused{token_id}>"
            if buf:
                parts.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
            if skip_special and token_id < len(_SPECIALS):
                continue
            parts.append(piece)
        if buf:
            parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_str(self, token_id: int) -> str:
        """Display string of one token (byte chunks shown as decoded, lossy)."""
        return self.decode((token_id,))

    def piece(self, token_id: int) -> str:
        """Text of one generated or vocabulary token (no byte chunks)."""
        piece = self._id_to_piece.get(token_id)
        if piece is None:
            raise UnknownTokenError(token_id)
        return piece

    def is_valid(self, token_id: int) -> bool:
        return 0 <= token_id < self.vocab_size or _CHUNK_BASE <= token_id < _CHUNK_MAX


def _chunk_ids(data: bytes) -> Iterable[int]:
    for start in range(0, len(data), 3):
        chunk = data[start : start + 3]
        yield _CHUNK_BASE + (((len(chunk) - 1) << 24) | int.from_bytes(chunk, "big"))


def _chunk_bytes(token_id: int) -> bytes:
    packed = token_id - _CHUNK_BASE
    n = (packed >> 24) + 1
    return (packed & 0xFFFFFF).to_bytes(3, "big")[3 - n :]


class TextGenConfig(BaseModel):
    """How the generator picks tokens and when it stops."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    context_window: int = Field(
        default=4,
        ge=1,
        le=64,
        description="k: how many trailing context tokens the next token depends on (tokens).",
    )
    mean_output_tokens: float = Field(
        default=128.0,
        ge=1.0,
        description=(
            "Mean output length under geometric stopping (tokens, default 128): each "
            "token is end-of-sequence with probability 1/mean."
        ),
    )


class TokenGenerator:
    """Deterministic next-token and end-of-sequence choices.

    Both are pure functions of ``(seed, context[-k:])`` (plus the absolute
    position for the EOS draw), so any two requests whose contexts agree at
    the tail choose the same next token.
    """

    def __init__(self, tokenizer: Tokenizer, config: TextGenConfig | None = None) -> None:
        self._config = config or TextGenConfig()
        self._k = self._config.context_window
        self._choices = tokenizer.generation_ids
        self._n_choices = len(self._choices)
        self._eos_threshold = int((1.0 / self._config.mean_output_tokens) * float(1 << 64))

    @property
    def config(self) -> TextGenConfig:
        return self._config

    def _state(self, seed: int, context: Sequence[int]) -> int:
        h = _mix64((seed ^ _SEED_SALT) & _MASK64)
        for token_id in context[-self._k :]:
            h = _mix64(h ^ token_id)
        return h

    def next_token(self, seed: int, context: Sequence[int]) -> int:
        """The token that follows ``context`` (never EOS)."""
        return self._choices[self._state(seed, context) % self._n_choices]

    def is_eos(self, seed: int, context: Sequence[int]) -> bool:
        """Whether the token at position ``len(context)`` is end-of-sequence."""
        h = _mix64(self._state(seed, context) ^ _EOS_SALT ^ len(context))
        return h < self._eos_threshold


def block_hashes(token_ids: Sequence[int], block_size: int = 16) -> tuple[int, ...]:
    """Chained hashes of each full ``block_size`` block of ``token_ids``.

    ``h_i = H(h_{i-1}, block_i)`` (64-bit BLAKE2b), so two prompts share
    ``h_0..h_j`` exactly when they share their first ``(j+1)*block_size``
    tokens, as in vLLM's automatic prefix caching. A trailing partial block
    gets no hash.
    """
    out: list[int] = []
    prev = b"\x00" * 8
    n_full = len(token_ids) // block_size
    fmt = f"<{block_size}Q"
    for i in range(n_full):
        block = token_ids[i * block_size : (i + 1) * block_size]
        digest = hashlib.blake2b(prev + struct.pack(fmt, *block), digest_size=8).digest()
        out.append(int.from_bytes(digest, "little"))
        prev = digest
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat turn: ``role`` (system, user, assistant, ...) and its text."""

    role: str
    content: str


def render_chat(
    messages: Sequence[ChatMessage] | Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt text for a chat, using this engine model's fixed template.

    Template: each message becomes ``<|role|>\\n{content}</s>\\n``; the
    generation prompt is ``<|assistant|>\\n``. With ``continue_final_message``
    the last message is left open (no ``</s>\\n``) and no generation prompt is
    added, so ``render(msgs + [assistant: partial], continue_final_message=True)
    == render(msgs) + partial``: a chat continuation resumes mid-answer.
    """
    items = [
        m if isinstance(m, ChatMessage) else ChatMessage(m["role"], m["content"]) for m in messages
    ]
    parts: list[str] = []
    for i, msg in enumerate(items):
        last = i == len(items) - 1
        parts.append(f"<|{msg.role}|>\n{msg.content}")
        if not (last and continue_final_message):
            parts.append("</s>\n")
    if add_generation_prompt and not continue_final_message:
        parts.append("<|assistant|>\n")
    return "".join(parts)
