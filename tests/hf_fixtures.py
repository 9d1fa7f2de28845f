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
