"""The typed configuration of a training run: one file, every command-line flag an override of it.

    tessera train --config run.toml                  # everything the run needs, reviewable, rerunnable
    tessera train --config run.toml --steps 20 --lr 1e-3     # a flag overrides one field

A config is TOML (`.toml`) or YAML (`.yaml`, `.yml`) with the sections of `RunConfig`: [model],
[data], [plan], [train], [optim], [eval], [checkpoint], [log], [run]. Each field is typed
(pydantic, strict: `steps = "10"` is refused, not read as 10), an unknown key is named with the
keys its section knows, and each field has one flag (`flag_table` lists them; `tessera train
--help` prints every flag with its default and its config field). Fields that exclude each
other (a plan file and a model name: the plan names its model) are refused in one line naming
where each came from. The run writes the resolved config, every field filled in, to
`<run dir>/config.toml` (`to_toml`), which `tessera train --config` reruns as it ran.

No torch import.
"""
from __future__ import annotations

import argparse
import difflib
import math
import tomllib
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import TesseraError

DEFAULT_MODEL = "tiny-llama"
# Models below this many parameters are CPU-sized: their default job is a demo's batch.
CPU_SIZED_PARAMS = 100e6


def option(default: Any, help: str, flag: str | None = None, metavar: str | None = None,
           default_text: str | None = None, **constraints) -> Any:
    """A config field with its flag: `help` (one phrase), `flag` (default `--<field-name>`),
    `default_text` (how `--help` states a default computed at run time)."""
    extra = {k: v for k, v in (("flag", flag), ("metavar", metavar), ("default_text", default_text)) if v}
    return Field(default, description=help, json_schema_extra=extra or None, **constraints)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelSection(Section):
    name: str = option(DEFAULT_MODEL, "model preset (e.g. llama3-8b) or a Hugging Face config.json (file or "
                       "directory)", flag="--model")
    init_from: str | None = option(None, "start from a Hugging Face checkpoint directory (its weights, "
                                   "tokenizer and chat template); the model is its config.json",
                                   metavar="HF_DIR", default_text="random initialisation")


class DataSection(Section):
    path: str | None = option(None, "a .txt/.jsonl/.bin/.npy file or a directory of them; with --init-from, "
                              "JSONL lines may be {\"text\": ...} or {\"messages\": [...]} (chat)",
                              flag="--data", metavar="PATH", default_text="Shakespeare's plays")
    synthetic: bool = option(False, "train on seeded random tokens instead", flag="--synthetic-data")
    global_batch: int | None = option(None, "sequences per optimizer step", metavar="N", gt=0,
                                      default_text="8 for models under 100M parameters, else 512")
    seq_len: int | None = option(None, "tokens per sequence", metavar="N", gt=0,
                                 default_text="128 for models under 100M parameters, else 4096 "
                                              "(capped at the model's maximum)")


class PlanSection(Section):
    file: str | None = option(None, "a plan JSON (from `tessera plan -o`) to execute as it is",
                              flag="--plan", metavar="PLAN_JSON", default_text="searched for this machine")
    nproc: int | None = option(None, "local ranks: launch torchrun with this many processes", metavar="N", gt=0,
                               default_text="1, or WORLD_SIZE under torchrun")
    cluster: str = option("auto", "what the plan is made for: 'auto' (a GPU: its preset; a CPU: a quick "
                          "measured profile of this machine at the run's rank count, cached), 'measure' (measure "
                          "again), 'builtin' (rough built-in CPU figures, no measurement) or a cluster JSON "
                          "(tessera profile hardware)", metavar="auto|measure|builtin|JSON")
    model_profile: str | None = option(None, "a measured model profile (tessera profile model) to plan with",
                                       metavar="JSON", default_text="the quick profile's on a CPU with "
                                       "--cluster auto, else none")
    adaptive: bool = option(False, "per-step sequence-parallel groups for each batch's documents (plans "
                            "plain data parallelism)")
    long_documents: Literal["error", "skip", "truncate"] = option(
        "error", "--adaptive: what to do with a document longer than any plan holds")
    ep: int | None = option(None, "search only plans whose MoE layers use this expert-parallel degree", gt=0,
                            metavar="N", default_text="any degree the search prefers")


class TrainSection(Section):
    steps: int = option(100, "optimizer steps (the run's last step; a resumed run continues to it)", ge=0)
    seed: int = option(0, "seed of the initial weights and of the data order")
    compile: bool = option(False, "torch.compile each block")


class OptimSection(Section):
    lr: float = option(3e-4, "peak learning rate", gt=0)
    weight_decay: float = option(0.1, "AdamW weight decay of matrices (norms and biases never decay)", ge=0)
    betas: tuple[float, float] = option((0.9, 0.95), "AdamW betas", metavar="B1,B2")
    eps: float = option(1e-8, "AdamW epsilon", gt=0)
    warmup_steps: int = option(10, "steps of linear warmup from lr/warmup to lr", flag="--warmup", ge=0)
    decay: Literal["cosine", "linear", "constant"] = option("cosine", "learning-rate decay after warmup, to "
                                                            "min_lr_ratio x lr at the last step")
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of lr", ge=0, le=1)
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0: no clipping)", ge=0)


class EvalSection(Section):
    every: int = option(0, "evaluate every N steps and after the last (0: never)", flag="--eval-every",
                        metavar="N", ge=0)
    batches: int = option(4, "global batches per evaluation", flag="--eval-batches", metavar="N", gt=0)
    fraction: float = option(0.05, "share of the data held out for evaluation (the end of the token "
                             "stream; taken out of training only when evaluation is on)",
                             flag="--eval-fraction", gt=0, lt=1)


class CheckpointSection(Section):
    dir: str | None = option(None, "where checkpoints go", flag="--checkpoint-dir", metavar="DIR",
                             default_text="<run dir>/checkpoints")
    every: int = option(0, "save every N steps (0: only at the end)", flag="--checkpoint-every", metavar="N",
                        ge=0)
    keep: int = option(3, "keep the latest N checkpoints, delete older ones after each save (0: keep all)",
                       flag="--checkpoint-keep", metavar="N", ge=0)
    final: bool = option(True, "save after the last step", flag="--final-checkpoint")
    resume: str | None = option(None, "continue from a run directory (its latest checkpoint, the same "
                                "metrics file), a checkpoint directory or one step-N", metavar="PATH",
                                default_text="start afresh")


class LogSection(Section):
    every: int = option(1, "log a step every N steps (metrics.jsonl, progress, TensorBoard, W&B)",
                        flag="--log-every", metavar="N", gt=0)
    progress: Literal["auto", "bar", "lines", "none"] = option(
        "auto", "a progress bar in a terminal, plain lines otherwise (auto), or either, or nothing")
    tensorboard: bool = option(False, "write TensorBoard scalars to <run dir>/tensorboard (needs tensorboard)")
    wandb: bool = option(False, "log to Weights & Biases (needs wandb; WANDB_MODE=offline works without a network)")
    wandb_project: str = option("tessera", "the Weights & Biases project", metavar="NAME")


class RunSection(Section):
    out: str = option("runs/{name}/{id}", "the run directory: resolved config, plan, metrics.jsonl, "
                      "checkpoints ({name} and {id} are filled in)", flag="--out", metavar="DIR")
    name: str | None = option(None, "the run's name (the {name} of --out)", metavar="NAME",
                              default_text="the model's name")
    id: str | None = option(None, "the run id in every metrics line (the {id} of --out)", flag="--run-id",
                            metavar="ID", default_text="the start time, YYYYmmdd-HHMMSS; a resumed run keeps its own")


class RunConfig(Section):
    """Everything `tessera train` needs. Sections and fields: see the module docstring and
    `tessera train --help`."""

    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    plan: PlanSection = Field(default_factory=PlanSection)
    train: TrainSection = Field(default_factory=TrainSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    log: LogSection = Field(default_factory=LogSection)
    run: RunSection = Field(default_factory=RunSection)

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        if self.optim.betas and not all(0 <= b < 1 for b in self.optim.betas):
            raise ValueError(f"optim.betas must lie in [0, 1), got {list(self.optim.betas)}")
        return self

    def section(self, name: str) -> Section:
        return getattr(self, name)

    def get(self, key: str) -> Any:
        section, field = key.split(".")
        return getattr(getattr(self, section), field)

    def replace(self, **updates: Any) -> "RunConfig":
        """A copy with `updates` ({"train.steps": 10, ...}) applied and validated."""
        data = self.to_dict()
        for key, value in updates.items():
            section, field = key.split(".")
            data[section][field] = value
        return RunConfig.model_validate(data, strict=False)

    def to_dict(self) -> dict:
        return self.model_dump(mode="python")


SECTIONS: tuple[str, ...] = tuple(RunConfig.model_fields)


def _section_model(name: str) -> type[Section]:
    return RunConfig.model_fields[name].annotation


# ----------------------------------------------------------------------------- defaults that follow the model

def default_shape(params: float, max_seq_len: int | None) -> tuple[int, int]:
    """(global batch, sequence length) of a model's default job: a CPU demo's 8 x 128 for models
    under 100M parameters, else 512 x 4096 (capped at the model's maximum sequence length). Every
    verb (`tessera plan`, `tessera train`) uses these, so one model has one default job."""
    if params < CPU_SIZED_PARAMS:
        batch, seq = 8, 128
    else:
        batch, seq = 512, 4096
    return batch, min(seq, max_seq_len) if max_seq_len else seq


# ----------------------------------------------------------------------------- reading files

def read_config_file(path: str | Path) -> dict:
    """The mapping in a TOML or YAML file (one-line errors for a missing or unparsable file)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise TesseraError(f"config file {path} does not exist")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            data = tomllib.loads(path.read_text())
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(path.read_text()) or {}
        else:
            raise TesseraError(f"config file {path} must end in .toml, .yaml or .yml")
    except tomllib.TOMLDecodeError as e:
        raise TesseraError(f"config file {path} is not valid TOML: {e}") from None
    except Exception as e:  # yaml.YAMLError and friends
        if isinstance(e, TesseraError):
            raise
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TesseraError(f"config file {path} is not valid YAML: {first}") from None
    if not isinstance(data, dict):
        raise TesseraError(f"config file {path} must hold a mapping of sections, not {type(data).__name__}")
    return data


# Names other tools use for a field, for the hint after an unknown key.
_ALIASES = {"learning_rate": "lr", "max_steps": "steps", "num_steps": "steps", "batch_size": "global_batch",
            "warmup": "warmup_steps", "clip": "grad_clip", "max_grad_norm": "grad_clip", "interval": "every",
            "max_seq_len": "seq_len", "sequence_length": "seq_len", "project": "wandb_project"}


def _unknown_key(where: str, key: str, known: list[str]) -> TesseraError:
    section, _, name = key.rpartition(".")
    alias = f"{section}.{_ALIASES[name]}" if section and name in _ALIASES else None
    close = [alias] if alias in known else difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; known: {', '.join(known)}"
    return TesseraError(f"{where}unknown key '{key}'{hint}")


def check_keys(data: dict, where: str = "") -> None:
    """Name the first unknown section or key (with the closest known one)."""
    for section, body in data.items():
        if section not in SECTIONS:
            raise _unknown_key(where, str(section), list(SECTIONS))
        if not isinstance(body, dict):
            raise TesseraError(f"{where}[{section}] must be a section of keys, not {_show(body)}")
        known = list(_section_model(section).model_fields)
        for key in body:
            if key not in known:
                raise _unknown_key(where, f"{section}.{key}", [f"{section}.{k}" for k in known])


_TYPE_WORDS = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
               "string_type": "a string", "tuple_type": "a list", "list_type": "a list",
               "literal_error": None, "int_from_float": "an integer", "float_parsing": "a number"}


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def describe_validation_error(e: ValidationError, where: str = "") -> TesseraError:
    """One line for the first error: 'run.toml: train.steps must be an integer, got "ten"'."""
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"] if not isinstance(p, int))
    word = _TYPE_WORDS.get(err["type"])
    if word:
        text = f"{loc} must be {word}, got {_show(err.get('input'))}"
    else:
        msg = err["msg"].removeprefix("Value error, ")
        text = f"{loc}: {msg}" if loc else msg
        if "input" in err and err["type"] != "value_error":
            text += f", got {_show(err['input'])}"
    return TesseraError(f"{where}{text}")


def parse_config(data: dict, where: str = "") -> RunConfig:
    """A validated `RunConfig` from a file's mapping (unknown keys and wrong types refused)."""
    check_keys(data, where)
    data = {s: dict(body) for s, body in data.items()}
    if "betas" in data.get("optim", {}) and isinstance(data["optim"]["betas"], list):
        data["optim"]["betas"] = tuple(data["optim"]["betas"])  # TOML and YAML have lists, no tuples
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise describe_validation_error(e, where) from None


def load_config(path: str | Path) -> RunConfig:
    return parse_config(read_config_file(path), f"{path}: ")


# ----------------------------------------------------------------------------- flags

class Flag:
    """One command-line flag and the config field it overrides."""

    def __init__(self, section: str, field: str):
        info = _section_model(section).model_fields[field]
        extra = info.json_schema_extra or {}
        self.section, self.field, self.key = section, field, f"{section}.{field}"
        self.flag = extra.get("flag") or f"--{field.replace('_', '-')}"
        self.dest = f"cfg__{section}__{field}"
        self.help, self.metavar = info.description, extra.get("metavar")
        self.annotation, self.default = info.annotation, info.default
        self.default_text = extra.get("default_text")

    @property
    def kind(self) -> type:
        args = [a for a in get_args(self.annotation) if a is not type(None)]
        if get_origin(self.annotation) is Literal:
            return str
        if get_origin(self.annotation) is tuple:
            return tuple
        return args[0] if args and get_origin(self.annotation) is not None else self.annotation

    @property
    def choices(self) -> tuple | None:
        return get_args(self.annotation) if get_origin(self.annotation) is Literal else None

    def default_shown(self) -> str:
        if self.default_text:
            return self.default_text
        if isinstance(self.default, tuple):
            return ",".join(str(v) for v in self.default)
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        return str(self.default)

    def add_to(self, parser) -> None:
        help_text = f"{self.help} (default: {self.default_shown()}; config: {self.key})"
        help_text = help_text.replace("%", "%%")
        names = ["-o", self.flag] if self.flag == "--out" else [self.flag]
        if self.kind is bool:
            parser.add_argument(*names, dest=self.dest, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
            return
        metavar = self.metavar or ("{" + ",".join(self.choices) + "}" if self.choices else self.field.upper())
        parser.add_argument(*names, dest=self.dest, type=self._parse, default=argparse.SUPPRESS,
                            metavar=metavar, help=help_text)

    def _parse(self, text: str):
        try:
            if self.kind is tuple:
                return tuple(float(v) for v in text.split(","))
            value = self.kind(text)
        except ValueError:
            word = {int: "an integer", float: "a number", tuple: "comma-separated numbers"}.get(self.kind, "valid")
            raise argparse.ArgumentTypeError(f"'{text}' is not {word}") from None
        if self.choices and value not in self.choices:
            raise argparse.ArgumentTypeError(f"'{text}' is not one of {', '.join(self.choices)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"'{text}' is not a finite number")
        return value


def flag_table() -> list[Flag]:
    """Every config field's flag, section by section."""
    return [Flag(s, f) for s in SECTIONS for f in _section_model(s).model_fields]


SECTION_TITLES = {"model": "model", "data": "data", "plan": "plan and launch", "train": "training",
                  "optim": "optimizer and learning rate", "eval": "evaluation on held-out data",
                  "checkpoint": "checkpoints", "log": "logging", "run": "run directory"}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """`--config FILE` and one flag per config field, grouped by section."""
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="a TOML or YAML run config (examples/*.toml); flags override its fields")
    for section in SECTIONS:
        group = parser.add_argument_group(SECTION_TITLES[section])
        for flag in flag_table():
            if flag.section == section:
                flag.add_to(group)


class Sources:
    """Where each field that is not a default came from: a flag or the config file."""

    def __init__(self, path: str | None, file_keys: set[str], flags: dict[str, str]):
        self.path, self.file_keys, self.flags = path, file_keys, flags

    def given(self, key: str) -> bool:
        return key in self.file_keys or key in self.flags

    def describe(self, key: str, value: Any) -> str:
        if key in self.flags:
            return f"{self.flags[key]} {_flag_value(value)}"
        return f"{key} = {_toml_value(value)} in {self.path}"


def _flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return "(on)" if value else "(off)"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


# Fields that exclude each other, and why. (A plan file and the model, batch and sequence length
# it fixes are checked against the plan once it is read: `check_plan_agrees`.)
CONFLICTS: tuple[tuple[str, str, str], ...] = (
    ("plan.file", "plan.model_profile", "a plan was made with its own profile"),
    ("model.init_from", "model.name", "the checkpoint's config.json is the model"),
    ("data.synthetic", "data.path", "synthetic data reads no files"),
)


def resolve_config(args: argparse.Namespace) -> tuple[RunConfig, Sources]:
    """The config file (if any) with the flags given on the command line applied; conflicts refused."""
    data: dict = {}
    path = getattr(args, "config", None)
    where = ""
    if path:
        data = read_config_file(path)
        where = f"{path}: "
        check_keys(data, where)
    file_keys = {f"{s}.{k}" for s, body in data.items() for k in body}
    flags: dict[str, str] = {}
    data = {s: dict(body) for s, body in data.items()}
    for flag in flag_table():
        if hasattr(args, flag.dest):
            data.setdefault(flag.section, {})[flag.field] = getattr(args, flag.dest)
            flags[flag.key] = flag.flag
    config = parse_config(data, where)
    sources = Sources(path, file_keys, flags)
    for a, b, why in CONFLICTS:
        if _set(config, sources, a) and _set(config, sources, b):
            first, second = sorted((a, b), key=lambda k: k not in flags)  # a flag first
            raise TesseraError(f"{sources.describe(first, config.get(first))} conflicts with "
                               f"{sources.describe(second, config.get(second))}: {why}; give one of them")
    return config, sources


def check_plan_agrees(config: RunConfig, sources: Sources, plan) -> None:
    """A plan file fixes the model, the global batch, the sequence length and the cluster: a field
    given for them must say the same (one line naming both)."""
    where = sources.describe("plan.file", config.plan.file)
    if sources.given("plan.cluster") and config.plan.cluster != "auto":
        raise TesseraError(f"{sources.describe('plan.cluster', config.plan.cluster)} conflicts with {where}: "
                           "a plan was made for its own cluster; give one of them")
    w = plan.workload
    for key, planned, what in (("model.name", plan.model.name, "model"), ("data.global_batch", w.global_batch,
                               "global batch"), ("data.seq_len", w.seq_len, "sequence length")):
        value = config.get(key)
        if sources.given(key) and value is not None and value != planned and not (
                key == "model.name" and config.model.init_from):
            raise TesseraError(f"{sources.describe(key, value)} conflicts with {where}, whose {what} is "
                               f"{planned}; give one of them")


def _set(config: RunConfig, sources: Sources, key: str) -> bool:
    """Given explicitly, and not to its default off/None value."""
    value = config.get(key)
    return sources.given(key) and value is not None and value is not False


# ----------------------------------------------------------------------------- writing

def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def to_toml(config: RunConfig, header: str = "") -> str:
    """The config as TOML, every field written (an unset optional one as a comment), so that
    `load_config` of the text gives the same config."""
    # A field another one excludes is written as a comment (a plan file names its model and batch).
    given_by = {b: a for a, b, _ in CONFLICTS if config.get(a) not in (None, False)}
    lines = [f"# {line}" for line in header.splitlines()]
    for section in SECTIONS:
        if lines:
            lines.append("")
        lines.append(f"[{section}]")
        for field, value in config.section(section).model_dump(mode="python").items():
            key = f"{section}.{field}"
            if value is None:
                lines.append(f"# {field} = (unset)")
            elif key in given_by:
                lines.append(f"# {field} = {_toml_value(value)}  (given by {given_by[key]})")
            else:
                lines.append(f"{field} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"
