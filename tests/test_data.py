"""Data: tokenizer, Shakespeare corpus, user directories, packing exactness, dp sharding, resume."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tessera.errors import TesseraError
from tessera.models.attention import document_causal_mask
from tessera.models.transformer import build_model
from tessera.runtime import data
from tessera.runtime.data import build_dataloader, play_scenes
from tessera.runtime.tokenizer import EOT_ID, decode, encode_documents, gpt2_tokenizer
from tessera.spec.presets import get_model_config


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private cache dir for the module (the corpus is tokenized once here, then read from it)."""
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("cache")
    mp.setenv("TESSERA_CACHE_DIR", str(path))
    yield path
    mp.undo()


def _write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))


@pytest.fixture(scope="module")
def short_docs_dir(tmp_path_factory, cache):
    """Many short documents of varied length, so that windows hold several of them."""
    rng = np.random.default_rng(0)
    words = "to be or not that is the question whether tis nobler in mind suffer slings".split()
    texts = [" ".join(rng.choice(words, size=int(rng.integers(3, 40)))) for _ in range(300)]
    root = tmp_path_factory.mktemp("docs")
    _write_jsonl(root / "a.jsonl", texts[:200])
    (root / "sub").mkdir()
    for i, t in enumerate(texts[200:]):
        (root / "sub" / f"{i:03d}.txt").write_text(t)
    return root, texts


def test_tokenizer_is_gpt2_bpe():
    tok = gpt2_tokenizer()
    assert tok.encode("Hello world").ids == [15496, 995]  # GPT-2's ids
    stream = encode_documents(["First doc.", "", "Second doc."])
    assert stream.dtype == np.uint16 and stream[0] == EOT_ID and (stream == EOT_ID).sum() == 2
    assert decode(stream) == "<|endoftext|>First doc.<|endoftext|>Second doc."


def test_play_markdown_to_scenes():
    md = ("# A Play\n\n## ACT I\n\n### SCENE I. A heath.\n\n_Thunder. Enter Witches_\n\n"
          "**First Witch**  \nWhen shall we meet?  \n\n_\\[Aside]_  \nSoon.\n\n"
          "## ACT II\n\n### SCENE I. A castle.\n\n**MACBETH**  \nSo foul and fair a day.\n")
    scenes = play_scenes(md)
    assert len(scenes) == 2
    assert scenes[0].startswith("A Play\n\nACT I\n\nSCENE I. A heath.\n\nThunder. Enter Witches\n\nFirst Witch:\n")
    assert "[Aside]\nSoon." in scenes[0] and not any(c in scenes[0] for c in "*_\\#")
    assert scenes[1] == "ACT II\n\nSCENE I. A castle.\n\nMACBETH:\nSo foul and fair a day.\n"


def test_shakespeare_corpus_is_real_text():
    """The default corpus (tokenized once per machine into the user's cache, as `tessera train` does)."""
    docs = data.shakespeare_documents()
    assert len(docs) > 700  # one document per scene of 38 plays
    text = "".join(docs)
    assert "Fair is foul, and foul is fair" in text and "**" not in text
    loader = build_dataloader(None, seq_len=256, global_batch=8)
    assert 1_200_000 < len(loader.stream) < 2_000_000
    assert isinstance(data.load_token_stream("shakespeare").segments[0], np.memmap)  # from the cache
    batch = next(loader)
    assert batch.tokens.shape == (8, 256) and batch.tokens.dtype == torch.int64
    assert torch.equal(batch.tokens[:, 1:], batch.labels[:, :-1])
    assert int(batch.tokens.max()) < loader.vocab_size == 50257
    head, _ = loader.stream.read(0, 12)
    assert decode(head).startswith("<|endoftext|>A Midsummer Night's Dream\n\nACT I")


def test_token_cache_is_written_once_atomically(cache):
    calls = []

    def documents():
        calls.append(1)
        return ["one document", "another"]

    first = data.cached_tokens("unit", documents)
    second = data.cached_tokens("unit", documents)
    assert len(calls) == 1 and isinstance(second, np.memmap) and np.array_equal(first, second)
    assert sorted(p.name for p in cache.iterdir() if "unit" in p.name and not p.name.endswith(".lock")) == [
        "tokens-unit.npy"]  # no temporary file left behind
    (cache / "tokens-unit.npy").write_bytes(b"\x93NUMPY garbage")  # a torn file is rebuilt, not trusted
    assert np.array_equal(data.cached_tokens("unit", documents), first) and len(calls) == 2


def test_packed_batch_equals_documents_one_by_one(short_docs_dir):
    root, _ = short_docs_dir
    loader = build_dataloader(str(root), seq_len=64, global_batch=4, seed=3)
    batch = next(loader)
    assert all(len(lens) >= 3 for lens in batch.seq_lens)  # several documents per row
    assert [sum(lens) for lens in batch.seq_lens] == [64] * 4
    for name in ("tiny-llama", "tiny-gpt2"):
        cfg = get_model_config(name).model_copy(update=dict(hidden=32, num_heads=4, num_kv_heads=2 if name == "tiny-llama" else 4,
                                                            ffn_hidden=48, num_layers=2))
        model = build_model(cfg, seed=1).eval()
        with torch.no_grad():
            packed = model(batch.tokens, positions=batch.positions, doc_ids=batch.doc_ids)
            for row in range(batch.tokens.shape[0]):
                for doc in batch.doc_ids[row].unique():
                    cols = (batch.doc_ids[row] == doc).nonzero().squeeze(1)
                    alone = model(batch.tokens[row, cols][None])
                    torch.testing.assert_close(packed[row, cols], alone[0], atol=2e-5, rtol=1e-5)


def test_positions_doc_ids_and_lengths():
    stream = data.TokenStream([np.array([5, EOT_ID, 7, 8, EOT_ID, 9, 10, 11, 12], dtype=np.uint16),
                               np.array([1, 2, 3, 4, 5, 6, 7], dtype=np.uint16)], "t")
    loader = data.TokenLoader(stream, seq_len=15, global_batch=1, shuffle=False)
    b = next(loader)
    # Documents start at each EOT and at the start of the second file (token 1).
    assert b.positions.tolist() == [[0, 0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]]
    assert b.seq_lens == [[1, 3, 5, 6]]
    assert b.cu_seqlens().tolist() == [0, 1, 4, 9, 15]
    assert b.doc_ids.tolist() == [[0, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3]]
    mask = document_causal_mask(b.doc_ids)[0, 0]
    assert mask.shape == (15, 15) and mask[3, 1] and not mask[4, 3] and not mask[1, 2]
    assert mask.sum() == sum(n * (n + 1) // 2 for n in [1, 3, 5, 6])
    plain = data.TokenLoader(stream, seq_len=15, global_batch=1, shuffle=False, pack=False).batch_at(0)
    assert plain.positions.tolist() == [list(range(15))] and plain.seq_lens == [[15]] and not plain.packed
    assert torch.equal(document_causal_mask(plain.doc_ids)[0, 0], torch.ones(15, 15, dtype=torch.bool).tril())


def test_same_global_batches_at_any_dp_size_and_exact_resume(short_docs_dir):
    root, _ = short_docs_dir
    args = dict(seq_len=32, global_batch=8, seed=7)
    single = build_dataloader(str(root), **args)
    reference = [next(single).tokens for _ in range(8)]
    two = [build_dataloader(str(root), dp_rank=r, dp_size=2, **args) for r in range(2)]
    for step in range(5):
        batches = [next(loader) for loader in two]
        assert batches[0].tokens.shape == (4, 32)
        assert torch.equal(torch.cat([b.tokens for b in batches]), reference[step])
    state = two[0].state_dict()
    assert state == two[1].state_dict() and json.loads(json.dumps(state)) == state  # plain data
    four = [build_dataloader(str(root), dp_rank=r, dp_size=4, **args) for r in range(4)]
    for loader in four:
        loader.load_state_dict(state)
    for step in range(5, 8):
        assert torch.equal(torch.cat([next(loader).tokens for loader in four]), reference[step])
    # Another seed is another order; a saved position refuses a loader it does not describe.
    other = build_dataloader(str(root), **{**args, "seed": 8})
    assert not torch.equal(next(other).tokens, reference[0])
    with pytest.raises(TesseraError, match="seq_len=32.*seq_len=16"):
        build_dataloader(str(root), **{**args, "seq_len": 16}).load_state_dict(state)


def test_every_window_once_per_epoch(short_docs_dir):
    root, _ = short_docs_dir
    loader = build_dataloader(str(root), seq_len=16, global_batch=4)
    w = loader.num_windows
    seen = loader._window_ids(np.arange(2 * w))
    assert sorted(seen[:w]) == list(range(w)) and sorted(seen[w:]) == list(range(w))
    assert not np.array_equal(seen[:w], seen[w:])  # each epoch reshuffles


def test_directory_of_text_and_token_files(tmp_path, short_docs_dir, cache):
    _, texts = short_docs_dir
    _write_jsonl(tmp_path / "b.jsonl", texts[:2])
    (tmp_path / "a.txt").write_text(texts[2])
    (tmp_path / "README.md").write_text("ignored")
    nano = np.array([1, 2, 3, EOT_ID, 4, 5], dtype=np.uint16)
    nano.tofile(tmp_path / "c.bin")
    np.save(tmp_path / "d.npy", np.array([6, 7, 8], dtype=np.int32))
    stream = data.load_token_stream(tmp_path)
    text_tokens = encode_documents([texts[2], texts[0], texts[1]])  # a.txt, then b.jsonl's lines
    expected = np.concatenate([text_tokens, nano, [6, 7, 8]])
    got, starts = stream.read(0, len(stream))
    assert np.array_equal(got, expected)
    assert starts.nonzero()[0].tolist() == [0, len(text_tokens), len(text_tokens) + len(nano)]
    assert stream.vocab_size == EOT_ID + 1
    # Token files only: the vocabulary is what they use.
    (tmp_path / "tok").mkdir()
    np.save(tmp_path / "tok" / "x.npy", np.arange(100, dtype=np.int64))
    assert data.load_token_stream(tmp_path / "tok").vocab_size == 100


def test_bad_data_is_one_sentence(tmp_path):
    def error(source, **kw):
        with pytest.raises(TesseraError) as e:
            build_dataloader(str(source), seq_len=kw.pop("seq_len", 4), global_batch=kw.pop("global_batch", 2), **kw)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "does not exist" in error(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("x")
    assert "no usable tokens" in error(tmp_path / "empty")
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "x.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    assert "x.jsonl:2" in error(tmp_path / "j")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.bin").write_bytes(b"abc")
    assert "odd" in error(tmp_path / "b")
    (tmp_path / "n").mkdir()
    np.save(tmp_path / "n" / "x.npy", np.zeros((2, 2), dtype=np.int32))
    assert "1-D integer" in error(tmp_path / "n")
    (tmp_path / "s").mkdir()
    np.save(tmp_path / "s" / "x.npy", np.arange(50, dtype=np.int32))
    assert "fewer than one global batch" in error(tmp_path / "s", seq_len=8, global_batch=8)
    assert "not divisible" in error(tmp_path / "s", global_batch=3, dp_size=2)
    assert "beyond the model's vocabulary of 32" in error(tmp_path / "s", model_vocab_size=32)
