"""gpt-oss's chat format (harmony) without a model: a vocabulary with o200k_harmony's special tokens (a GGUF written
here, trained on inline text). The frame markers survive decoding; <|end|> ends no generation."""

from __future__ import annotations

import pytest
from vocab_fixtures import write_byte_level_gguf

# o200k_harmony's special tokens (the real ids differ; the names are what the template, parser and grammar use)
SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
            "<|message|>", "<|call|>"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from llmd.model.gguf import read_gguf_metadata
    from llmd.model.tokenizer import Tokenizer

    path = write_byte_level_gguf(tmp_path_factory.mktemp("harmony") / "harmony.gguf", "gpt-4o", SPECIALS, [],
                                 bos="<|startoftext|>", eos="<|return|>", add_bos=False)
    return Tokenizer.from_gguf(read_gguf_metadata(path), path)


def ids_of(tok, *names: str) -> set[int]:
    return {tok.backend.token_to_id(n) for n in names}


# --- the vocabulary ------------------------------------------------------------------------------

def test_markers_are_decoded_and_end_is_no_eos(tok, smollm2_gguf):
    from llmd.model.gguf import read_gguf_metadata
    from llmd.model.tokenizer import IncrementalDetokenizer, Tokenizer

    # <|return|> and <|call|> end the generation; <|end|> ends a message only, though llama.cpp's end-of-turn list
    # (which a GGUF's tokens are matched against) names it
    assert ids_of(tok, "<|return|>", "<|call|>", "<|endoftext|>") <= tok.eos_token_ids
    assert tok.message_end_ids == ids_of(tok, "<|end|>") and not tok.message_end_ids & tok.eos_token_ids
    text = "<|startoftext|><|channel|>analysis<|message|>Think, then answer.<|end|><|start|>assistant"
    ids = tok.encode(text)
    assert ids_of(tok, "<|channel|>", "<|message|>", "<|end|>", "<|start|>") <= set(ids)
    shown = text.removeprefix("<|startoftext|>")  # the frame markers are shown, other special tokens are not
    assert tok.decode(ids) == shown
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push(i) for i in ids) + detok.flush() == shown
    smol = Tokenizer.from_gguf(read_gguf_metadata(smollm2_gguf), smollm2_gguf)  # other vocabularies: as before
    assert not smol.shown_special_ids and not smol.message_end_ids and smol.hidden_ids == smol.special_ids
