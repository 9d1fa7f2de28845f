"""A model's own tokenizer and chat template for fine-tuning data; bad input answered in one line.

Tokenizers are trained here on a few sentences (`tests/hf_fixtures.py`); transformers'
`apply_chat_template` is the reference for the rendered text and the token ids."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from tessera.cli import main
from tessera.errors import TesseraError
from tessera.models.hf_load import load_hf_shards
from tessera.models.transformer import Transformer
from tessera.runtime.chat import ChatRenderer, render_chatml
from tessera.runtime.data import build_dataloader
from tessera.runtime.finetune_data import finetune_stream
from tessera.runtime.hf_tokenizer import DOC_START, NO_LOSS, HFTokenizer
from tests.hf_fixtures import CHATML, INST, save_hf_dir, write_data, write_tokenizer

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "i am fine"}, {"role": "user", "content": "two plus two"},
        {"role": "assistant", "content": "is four"}]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("template", [CHATML, INST], ids=["chatml", "inst"])
def test_chat_matches_transformers_and_trains_assistant_turns_only(tmp_path, template):
    write_tokenizer(tmp_path, template=template)
    mine = HFTokenizer(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    chat = CHAT if template == CHATML else CHAT[1:]  # the INST template refuses system turns
    assert mine.renderer.render(chat) == theirs.apply_chat_template(chat, tokenize=False)
    ids, flags = mine.encode_chats([(chat, "sample")])[0]
    expected = theirs.apply_chat_template(chat, tokenize=True)
    assert ids.tolist() == list(expected if isinstance(expected, list) else expected["input_ids"])
    trained = mine.decode(ids[(flags & NO_LOSS) == 0])
    end = "<|im_end|>\n" if template == CHATML else "</s>"
    lead = "" if template == CHATML else " "
    assert trained == f"{lead}i am fine{end}{lead}is four{end}"
    assert flags[0] & DOC_START and not (flags[1:] & DOC_START).any()
    # Text documents: [BOS] text [EOS], with the ids transformers gives the text.
    text_ids, text_flags = mine.encode_texts(["hello there"])[0]
    assert text_ids.tolist() == [mine.bos_id, *theirs("hello there").input_ids, mine.eos_id]
    assert not (text_flags & NO_LOSS).any()


def test_chatml_fallback_without_template(tmp_path):
    write_tokenizer(tmp_path, template=None)
    tok = HFTokenizer(tmp_path)
    assert tok.chat_template is None
    text, spans = tok.renderer.render_with_spans(CHAT)
    assert text == render_chatml(CHAT)
    assert [text[a:b] for a, b in spans] == ["i am fine<|im_end|>\n", "is four<|im_end|>\n"]
    assert ChatRenderer(CHATML).render(CHAT, add_generation_prompt=True) == render_chatml(CHAT, True)


def test_loader_labels_positions_and_target_count(tmp_path):
    write_tokenizer(tmp_path / "tok")
    tok = HFTokenizer(tmp_path / "tok")
    (tmp_path / "d").mkdir()
    (tmp_path / "d/c.jsonl").write_text("\n".join(json.dumps({"messages": CHAT}) for _ in range(6)))
    loader = build_dataloader(tmp_path / "d", 16, 4, 1, 2, seed=0, tokenizer=tok)  # rank 1 of 2
    batch = next(loader)
    whole = build_dataloader(tmp_path / "d", 16, 4, 0, 1, seed=0, tokenizer=tok).batch_at(0)
    assert torch.equal(whole.labels[2:], batch.labels)  # rank 1's rows of the global batch
    assert batch.num_targets == whole.num_targets == int((whole.labels != -100).sum())
    stream = finetune_stream(tmp_path / "d", tok)
    ids, flags = stream.segments[0], stream.flags[0]
    for row in range(4):  # label = next token where it is a target, else -100; positions restart
        w = loader._window_ids(np.array([row]))[0]
        nxt = slice(w * 16 + 1, w * 16 + 17)
        target = (flags[nxt] & (DOC_START | NO_LOSS)) == 0
        assert np.array_equal(whole.labels[row].numpy(), np.where(target, ids[nxt].astype(np.int64), -100))
        starts = (flags[w * 16: w * 16 + 16] & DOC_START) != 0
        assert all(whole.positions[row, i] == 0 for i in np.flatnonzero(starts))


def test_token_cache_key_is_the_tokenizers_fingerprint(tmp_path):
    write_data(tmp_path / "data")
    write_tokenizer(tmp_path / "a", vocab_size=300)
    write_tokenizer(tmp_path / "b", vocab_size=280)
    a, b = HFTokenizer(tmp_path / "a"), HFTokenizer(tmp_path / "b")
    assert a.fingerprint != b.fingerprint
    sa, sb = finetune_stream(tmp_path / "data", a), finetune_stream(tmp_path / "data", b)
    assert len(sa) != len(sb)  # each tokenizer its own ids, not the other's cached ones
    assert len(list((tmp_path / "cache").glob("tokens-*.npy"))) == 2
    assert np.array_equal(finetune_stream(tmp_path / "data", a).segments[0], sa.segments[0])  # from the cache


def test_fused_expert_layout_loads(tmp_path):
    """A Mixtral saved as transformers >= 5 holds it in memory (fused gate_up/down experts)."""
    from safetensors.torch import save_file

    from tessera.models import hf

    model = save_hf_dir("mixtral", tmp_path / "hub")
    (tmp_path / "fused").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "fused/model.safetensors"))
    (tmp_path / "fused/config.json").write_text((tmp_path / "hub/config.json").read_text())
    cfg, want = hf.load_hf_checkpoint(tmp_path / "hub")
    with torch.device("meta"):
        built = Transformer(cfg)
    stats = load_hf_shards(built, tmp_path / "fused", cfg, "cpu")
    assert stats.bytes_read == stats.local_bytes == sum(t.numel() * 4 for t in want.values())
    for k, v in want.items():
        assert torch.equal(built.state_dict()[k], v), k


# ----------------------------------------------------------------------------- bad input

def _one_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_input_is_one_line(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    save_hf_dir("llama", hf_dir)
    data = write_data(tmp_path / "data")
    train = ["train", "--steps", "1", "--data", str(data), "--out", str(tmp_path / "run"), "--cluster", "builtin"]
    capsys.readouterr()  # transformers' progress bars

    (tmp_path / "empty").mkdir()
    assert "has no config.json" in _one_line(capsys, train + ["--init-from", str(tmp_path / "empty")])

    shards = sorted(hf_dir.glob("model-*.safetensors"))
    broken = tmp_path / "missing"
    broken.mkdir()
    for f in hf_dir.iterdir():
        if f != shards[1]:
            (broken / f.name).write_bytes(f.read_bytes())
    err = _one_line(capsys, train + ["--init-from", str(broken)])
    assert f"shard '{shards[1].name}'" in err and "is missing" in err

    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for f in hf_dir.iterdir():
        (truncated / f.name).write_bytes(f.read_bytes())
    (truncated / shards[0].name).write_bytes(shards[0].read_bytes()[:-100])
    assert "is truncated" in _one_line(capsys, train + ["--init-from", str(truncated)])

    big = tmp_path / "big_vocab"
    big.mkdir()
    for f in hf_dir.iterdir():
        (big / f.name).write_bytes(f.read_bytes())
    config = json.loads((big / "config.json").read_text())
    write_tokenizer(big, vocab_size=600)  # more ids than the model's 320 embedding rows
    err = _one_line(capsys, train + ["--init-from", str(big)])
    assert "more than the model's embedding of 320 rows" in err and config["vocab_size"] == 320

    (tmp_path / "chat").mkdir()
    (tmp_path / "chat/c.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    err = _one_line(capsys, ["train", "--steps", "1", "--data", str(tmp_path / "chat"), "--init-from", str(hf_dir)])
    assert "c.jsonl:1: the conversation has no assistant turn" in err


def test_missing_shard_message(tmp_path):
    from tessera.models.hf_load import stored_tensors

    hf_dir = tmp_path / "hf"
    save_hf_dir("gpt2", hf_dir)
    shard = sorted(hf_dir.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(TesseraError, match=f"shard '{shard.name}' of '.*' is missing"):
        stored_tensors(hf_dir)


def test_export_bad_input(tmp_path, capsys):
    assert "does not exist" in _one_line(capsys, ["export", str(tmp_path / "nope"), str(tmp_path / "out")])
    step = tmp_path / "ckpt" / "step-3"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"version": 1, "step": 3, "files": {}}))
    err = _one_line(capsys, ["export", str(tmp_path / "ckpt"), str(tmp_path / "out")])
    assert "has no model/config.json" in err


def test_builtin_gpt2_tokenizer_exports_loadable(tmp_path):
    from tessera.runtime.export import _write_tokenizer
    from tessera.runtime.tokenizer import gpt2_tokenizer

    (tmp_path / "step/model").mkdir(parents=True)
    (tmp_path / "step/model/meta.json").write_text(json.dumps({"tokenizer": "gpt2"}))
    (tmp_path / "out").mkdir()
    _write_tokenizer(tmp_path / "step", tmp_path / "out")
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "Shall I compare thee to a summer's day?"
    assert loaded(text).input_ids == gpt2_tokenizer().encode(text).ids
    assert loaded.eos_token == "<|endoftext|>"


def test_train_init_from_cli_single_process(tmp_path):
    """`tessera train --init-from` end to end on one process (a plan made for the checkpoint's model),
    then `tessera export` of its checkpoint; the first loss is the checkpoint's loss on the batch."""
    from tests.hf_fixtures import GLOBAL_BATCH, SEQ, global_batch, transformers_loss

    hf_dir = tmp_path / "hf"
    save_hf_dir("qwen2", hf_dir)
    data = write_data(tmp_path / "data")
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tessera", "train", "--init-from", str(hf_dir), "--data", str(data), "--steps", "1",
           "--seq-len", str(SEQ), "--global-batch", str(GLOBAL_BATCH), "--out", str(tmp_path / "run"), "--cluster", "builtin",
           "--checkpoint-dir", str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[0])
    want = transformers_loss(hf_dir, global_batch(hf_dir, data, 0))
    assert abs(record["loss"] - want) < 1e-5 * want
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.tie_word_embeddings
