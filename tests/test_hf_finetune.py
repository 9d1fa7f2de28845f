"""Fine-tune from and back to Hugging Face: `--init-from` under many plans (one torchrun launch at
4 ranks), the first loss against transformers, `tessera export` of the checkpoints it writes
against transformers' logits, for every supported family (tiny random models saved offline)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from tests.hf_fixtures import FAMILIES, global_batch, one_process_losses, save_hf_dir, transformers_loss, write_data
from tests.torchrun_util import passed_checks, run_torchrun
from tessera.cli import main
from tessera.models.hf_load import hf_model_config
from tessera.models.transformer import Transformer
from tessera.runtime.checkpoint import CheckpointManager

SCRIPT = Path(__file__).parent / "dist" / "hf_finetune.py"
EXPECTED_CHECKS = {"llama_zero3_dp4_meta", "llama_pp2_dp2_full", "qwen2_tied_hsdp_shard2_meta", "mistral_ddp_dp4_full",
                   "mixtral_zero2_dp2_tp2_sp_meta", "gpt2_tied_tp4_meta", "gradients_masked_packed_layerwise_microbatch2"}


@pytest.mark.dist
def test_init_from_under_plans_and_export_every_family(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    data = write_data(tmp_path / "data")
    expected = {}
    for i, family in enumerate(FAMILIES):
        hf_dir = tmp_path / family / "hf"
        save_hf_dir(family, hf_dir, seed=i)
        assert len(list(hf_dir.glob("model-*.safetensors"))) > 1  # sharded, with an index
        batch = global_batch(hf_dir, data, 0)
        assert 0 < batch.num_targets < batch.labels.numel()  # prompts and document starts are not targets
        first = transformers_loss(hf_dir, batch)
        losses = one_process_losses(hf_dir, data)
        assert abs(losses[0] - first) < 1e-5 * first, (family, losses[0], first)
        expected[family] = {"transformers_first_loss": first, "one_process": losses}
    (tmp_path / "expected.json").write_text(json.dumps(expected))

    out = run_torchrun(SCRIPT, 4, str(tmp_path))
    assert passed_checks(out) == EXPECTED_CHECKS, out[-3000:]

    # Each family's checkpoint (written at 4 ranks under its plan) exports to a directory that
    # transformers loads with the logits of the trained Tessera model.
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    for family in FAMILIES:
        out_dir = tmp_path / family / "export"
        assert main(["export", str(tmp_path / family / "ckpt"), str(out_dir), "--max-shard-size", "100KB"]) == 0
        index = json.loads((out_dir / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        model = Transformer(hf_model_config(tmp_path / family / "hf"))
        CheckpointManager(tmp_path / family / "ckpt").load([model])
        exported = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
        assert exported.config.model_type == family
        with torch.no_grad():
            torch.testing.assert_close(exported(tokens).logits, model.eval()(tokens), atol=1e-5, rtol=1e-5)
        tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
        original = transformers.AutoTokenizer.from_pretrained(tmp_path / family / "hf")
        messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
        assert tokenizer.apply_chat_template(messages, tokenize=False) == \
            original.apply_chat_template(messages, tokenize=False)
