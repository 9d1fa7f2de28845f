"""Tiny Hugging Face model directories built offline: a random model per family that `transformers`
saves (config.json + safetensors, sharded with an index), a tiny byte-level BPE tokenizer trained
here on a few sentences (tokenizer.json + tokenizer_config.json with BOS/EOS and a chat template),
and fine-tuning data (text and chat JSONL). Shared by the pytest tests and tests/dist/ scripts."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

SENTENCES = [
    "the quick brown fox jumps over the lazy dog", "a stitch in time saves nine",
    "all that glitters is not gold", "to be or not to be that is the question",
    "the rain in spain stays mainly in the plain", "hello there how are you today",
    "i am fine thank you and you", "what is the capital of france", "paris is the capital of france",
    "two plus two is four", "count from one to five please", "one two three four five",
]
SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
# LLaMA-2 style: BOS written by the template, EOS closes each assistant turn, system refused.
INST = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
        "{{ ' ' + message['content'] + eos_token }}{% else %}{{ raise_exception('only user and assistant roles') }}"
        "{% endif %}{% endfor %}")
VOCAB = 320  # the models' embedding rows (the tokenizer has fewer ids, as Qwen's checkpoints do)


def write_tokenizer(directory: Path, vocab_size: int = 300, template: str | None = CHATML,
                    bos: str | None = "<s>", eos: str = "</s>") -> None:
    """A byte-level BPE trained on SENTENCES (every byte is in it: any text encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 4, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "model_max_length": 64}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
             pad_token_id=None)


def hf_model(family: str):
    import transformers

    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, rope_theta=500.0))
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, tie_word_embeddings=True))
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=None))
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**SMALL, num_local_experts=4,
                                                                           num_experts_per_tok=2))
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=4, eos_token_id=4))
    raise ValueError(family)


FAMILIES = ("llama", "qwen2", "mistral", "mixtral", "gpt2")


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Large weights and random norm gains, so that any layout error shows far above rounding."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "ln" in name or "norm" in name else 0.15 * noise)


def save_hf_dir(family: str, directory: Path, seed: int = 0, shard_size: str = "60KB",
                template: str | None = CHATML):
    """A random `family` model saved by transformers (sharded, with an index) and the tiny tokenizer."""
    torch.manual_seed(seed)
    model = hf_model(family).eval()
    randomize(model, seed + 1)
    model.save_pretrained(directory, max_shard_size=shard_size)
    if family == "gpt2":
        write_tokenizer(directory, template=template, bos="<|endoftext|>", eos="<|endoftext|>")
    else:
        write_tokenizer(directory, template=template)
    return model


def write_data(directory: Path, seed: int = 0, chats: int = 24, texts: int = 12) -> Path:
    """A directory with one text JSONL file and one chat JSONL file (system / user / assistant turns)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "a_text.jsonl", "w") as f:
        for _ in range(texts):
            f.write(json.dumps({"text": " ".join(rng.sample(SENTENCES, 3))}) + "\n")
    with open(directory / "b_chat.jsonl", "w") as f:
        for _ in range(chats):
            turns = [{"role": "system", "content": "be brief"}] if rng.random() < 0.3 else []
            for _ in range(rng.choice([1, 2])):
                turns += [{"role": "user", "content": rng.choice(SENTENCES)},
                          {"role": "assistant", "content": rng.choice(SENTENCES)}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return directory


# ----------------------------------------------------------------------------- references

SEQ, GLOBAL_BATCH, STEPS = 32, 8, 2


def optim_config():
    from tessera.runtime.optim import OptimConfig

    return OptimConfig(lr=1e-3, warmup_steps=1, total_steps=STEPS, grad_clip=1.0)


def global_batch(hf_dir: Path, data: Path, step: int, seed: int = 0):
    """Step `step`'s whole global batch, as the trainer's loader makes it (the model's tokenizer)."""
    from tessera.runtime.data import build_dataloader
    from tessera.runtime.hf_tokenizer import HFTokenizer

    loader = build_dataloader(data, SEQ, GLOBAL_BATCH, 0, 1, seed, tokenizer=HFTokenizer(hf_dir))
    return loader.batch_at(step * GLOBAL_BATCH)


def _segments(batch):
    for row in range(batch.tokens.shape[0]):
        lens = torch.unique_consecutive(batch.doc_ids[row], return_counts=True)[1].tolist()
        start = 0
        for n in lens:
            yield row, start, start + n
            start += n


def transformers_loss(hf_dir: Path, batch) -> float:
    """transformers' mean cross-entropy over the batch's targets, each packed document run alone."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    logits = torch.empty(*batch.tokens.shape, model.config.vocab_size)
    with torch.no_grad():
        for row, lo, hi in _segments(batch):
            logits[row, lo:hi] = model(batch.tokens[row:row + 1, lo:hi]).logits[0]
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()))


def tessera_loss(model, batch) -> torch.Tensor:
    """The trainer's objective on the whole global batch, in one process: sum over targets / their count."""
    logits = model(batch.tokens, batch.positions, batch.doc_ids)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), reduction="sum")
    return loss / max(batch.num_targets, 1)


def one_process_losses(hf_dir: Path, data: Path) -> list[float]:
    """STEPS steps of the trainer's AdamW, schedule and clipping on one process, from the checkpoint."""
    from tessera.models import hf
    from tessera.runtime.optim import build_optimizer, build_scheduler, clip_grad_norm_

    model = hf.load_pretrained(hf_dir)
    opt = build_optimizer(model.parameters(), optim_config())
    sched = build_scheduler(opt, optim_config())
    losses = []
    for step in range(STEPS):
        loss = tessera_loss(model, global_batch(hf_dir, data, step))
        loss.backward()
        clip_grad_norm_(list(model.parameters()), optim_config().grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
