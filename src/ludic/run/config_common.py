"""Config sections shared by policy and reward-model runs (see :mod:`ludic.run.config`).

The base of every section (frozen, unknown fields refused, no inf/nan), the checked
string types (devices, registered names), the tiny model, LoRA and a vLLM server.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    create_model,
    field_validator,
    model_validator,
)

from ludic._imports import absolute_target
from ludic.run.registries import (
    ALGORITHM,
    CREDIT_ASSIGNER,
    ENV,
    PARSER,
    PROGRAM,
    REWARD_FUNCTION,
    TOOL,
    PartKind,
    check_choice,
)

__all__ = [
    "AlgorithmName",
    "CreditAssignerName",
    "Device",
    "EnvKind",
    "LoraConfig",
    "ModuleReference",
    "ParserName",
    "ProgramName",
    "RewardFunctionName",
    "ToolName",
    "PolicyServersConfig",
    "Section",
    "TinyModelConfig",
    "VLLMConfig",
    "settings_section",
]


def _part(kind: PartKind) -> AfterValidator:
    return AfterValidator(lambda value: check_choice(kind, value))


def _module_reference(value: str) -> str:
    if not value.strip():
        raise ValueError("empty; name a module (package.module) or a .py file")
    return absolute_target(value)


def _device(name: str) -> str:
    if not re.fullmatch(r"(cpu|cuda|mps|xpu)(:\d+)?", name):
        raise ValueError("not a device; use cpu, cuda, cuda:N, mps or xpu")
    return name


Device = Annotated[str, AfterValidator(_device)]
"""A torch device string, checked without importing torch (availability is checked by
``ludic.run.preflight`` before the run starts)."""
EnvKind = Annotated[str, _part(ENV)]
"""A registered env kind (``ludic.run.registries.ENVS``) or your own env, named as code."""
ParserName = Annotated[str, _part(PARSER)]
AlgorithmName = Annotated[str, _part(ALGORITHM)]
CreditAssignerName = Annotated[str, _part(CREDIT_ASSIGNER)]
RewardFunctionName = Annotated[str, _part(REWARD_FUNCTION)]
ToolName = Annotated[str, _part(TOOL)]
ProgramName = Annotated[str, _part(PROGRAM)]
ModuleReference = Annotated[str, AfterValidator(_module_reference)]
"""A module to import: ``package.module`` or ``path/to/file.py`` (made absolute)."""


class Section(BaseModel):
    """The base of every config section. ``removed`` maps a field name a section no
    longer has to what to write instead; a config that still sets it is refused with that
    message (unless it holds the value the old field meant "off" with, as a config saved
    by an earlier ludic does)."""

    # allow_inf_nan=False: lr=inf (or nan) is refused here, not after the warm start.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    removed: ClassVar[Mapping[str, tuple[Any, str]]] = {}
    """Old field -> (its old "off" value, what to write instead)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_removed_fields(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or not cls.removed:
            return data
        for old, (off, instead) in cls.removed.items():
            if old in data and data[old] != off:
                raise ValueError(f"{old} was removed; {instead}")
        return {k: v for k, v in data.items() if k not in cls.removed}

    def non_default(self, names: Iterable[str]) -> list[str]:
        """Those of the fields ``names`` holding another value than their default (written
        with it: a saved config writes every default)."""
        return [n for n in names if getattr(self, n) != type(self).model_fields[n].default]


def settings_section(name: str, source: type, fields: Sequence[str], *, doc: str) -> type[Section]:
    """A :class:`Section` whose fields are ``fields`` of the dataclass ``source``, with its
    types, defaults and attribute docstrings: a config section and a Python settings object
    with one schema between them (``TrainerConfig`` -> ``trainer.*``), not a hand copy."""
    hints = typing.get_type_hints(source)
    defaults = {f.name: f.default for f in dataclasses.fields(source)}
    docs = _attribute_docs(source)
    unknown = sorted(set(fields) - set(defaults))
    if unknown:
        raise TypeError(f"settings_section({name}): {source.__name__} has no {unknown}")
    spec: dict[str, Any] = {
        field: (hints[field], Field(defaults[field], description=docs.get(field)))
        for field in fields
    }
    section = create_model(name, __base__=Section, __module__=__name__, **spec)
    section.__doc__ = doc

    def settings_object(self: Section, **rest: Any) -> Any:
        """A ``source`` built from these fields' values and ``rest`` (its other fields)."""
        return source(**{field: getattr(self, field) for field in fields}, **rest)

    section.settings_object = settings_object  # type: ignore[attr-defined]
    return section


def _attribute_docs(cls: type) -> dict[str, str]:
    """``field -> the string literal under it`` in ``cls``'s source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


class TinyModelConfig(Section):
    """The locally built tiny Qwen2 (used when ``model.path`` is null)."""

    hidden_size: int = Field(128, ge=32, description="hidden width; head size must be >= 32")
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(2, ge=1)
    seed: int = 0

    @model_validator(mode="after")
    def _head_size(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 32:
            raise ValueError(
                f"hidden_size={self.hidden_size} / num_heads={self.num_heads} must give an "
                "integer head size >= 32 (vLLM's CPU backend needs it)"
            )
        return self


class LoraConfig(Section):
    """peft LoRA adapters on the policy."""

    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = ["q_proj", "v_proj"]
    sync: Literal["adapter", "merged"] = "adapter"
    """What the vLLM backend publishes: ``adapter``, the LoRA tensors alone, loaded by
    vLLM's LoRA support and serving every request (a server ludic starts gets
    ``--lora-rank r``; start a running one with it), or ``merged``, ``W + BA`` under the
    base model's names. The transformers backend and the pipeline's Redis weights take
    the merged weights; the reward model's ``lora`` ignores it."""


class VLLMConfig(Section):
    """A vLLM policy server (the vLLM backend; see the policy-serving docs)."""

    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=1, le=65535)
    """HTTP port (null: a free one when ludic starts the server)."""
    group_port: int | None = Field(None, ge=1, le=65535)
    """Rendezvous port of the weight-sync group, hosted by the trainer (null: a free one)."""
    group_host: str | None = None
    """The trainer's address as the servers reach it, for the weight-sync rendezvous
    (null: ``host``, right when trainer and server share a machine)."""
    start_server: bool = True
    """Start (and stop) the server as a subprocess; false = connect to a running one."""
    sync_backend: Literal["nccl", "gloo"] | None = None
    """Process-group backend of the weight sync (null: nccl when model.device is cuda,
    else gloo)."""
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    extra_args: list[str] = []
    timeout_s: float = Field(120.0, gt=0)
    """Bound on every call to the server, and the base of each weight-sync stage's deadline:
    a stage that moves bytes (broadcast, load) gets this plus their time at 20 MB/s. A stage
    past its deadline stops the run naming the stage, the server and the bytes sent."""
    verify_sync: Literal["every", "first", "off"] = "every"
    """Verify weight syncs: each server's workers report the checksums of every tensor as
    received and of every served parameter as loaded, and the trainer checks them against
    what it sent; a mismatch (or a server restarted since the group formed) stops the run
    with an error naming the server, the tensor and the step. every (the default): each
    sync; first: the first only; off: never (``ludic.distributed.weight_transfer.verify``).
    The policy's setting also applies to the in-process backend (``inference.backend:
    transformers``), whose copy is read back after each sync."""
    canary_every: int = Field(10, ge=0)
    """While verification is on: after the first sync and every this many syncs, the
    server's logprobs of a fixed token sequence (a reward server being trained: its raw
    score of it) are checked against the trainer's (``ludic.inference.vllm.canary``); 0:
    never. Not run for a sharded trainer."""
    api_key: str | None = Field(None, exclude=True, repr=False)
    """The server's API key (every route but /health needs it). null: $LUDIC_API_KEY if
    set, else a fresh random key for a server ludic starts (none for a running one).
    Never saved to the run directory nor shown in logs."""


class PolicyServersConfig(VLLMConfig):
    """The policy's vLLM servers: one, or several behind a ``VLLMClientPool``
    (``ludic.inference.vllm.pool``: least in flight, an episode sticks to one server, a
    dead server is taken out and its requests sent elsewhere)."""

    partial_rollouts: Literal["off", "continue", "restart"] = "continue"
    """What a publish does to the completions in flight. continue (the default): it pauses
    the server (in-flight requests end, the weights load, it resumes) and each one is
    continued from the tokens generated so far, so every token carries the version that
    sampled it (e.g. 3, 3, 3, 4, 4); restart: they are sent again, every token from the new
    version; off: no pause, so a completion may straddle the update token by token
    unknown (its trace's version_end says how new its tokens may be, and staleness and
    trainer.max_version_span count it). See ``ludic.inference.vllm.partial``. The
    in-process backend needs none of this: a publish waits for the generation in progress."""

    @field_validator("partial_rollouts", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false

    num_servers: int = Field(1, ge=1)
    """Servers ludic starts on the policy, each on a free port; more than one needs
    ``port`` null."""
    urls: list[str] = []
    """Base URLs of running servers to pool (``start_server`` false); empty: the one at
    ``host``:``port``."""
    publish: Literal["per_server", "one_group"] = "per_server"
    """How a publish reaches several servers: a weight-sync group per server, pushed
    concurrently (a dead server fails only its own push), or one group spanning every
    server's workers (one broadcast). ``group_port`` is the first group's port; server i's
    is ``group_port + i`` in per_server."""
    cpu_cores: list[str] = []
    """CPU only: the cores of each server, e.g. ["0-3", "4-7"] (``VLLM_CPU_OMP_THREADS_BIND``;
    every process of server i is also pinned there). With ``tensor_parallel_size`` > 1,
    one set per worker joined by ``|``, e.g. ["0|1"] (required then: vLLM's own binding
    wants a NUMA node per worker). Empty: vLLM's own binding."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Workers each server shards the model over (vLLM ``--tensor-parallel-size``: GPUs on
    CUDA, processes on CPU). A weight sync sends every worker the full tensors and each
    loads its own shard; verification adds the shards' checksums up."""

    sync_strategy: Literal["broadcast", "cuda_ipc", "packed_cuda_ipc"] = "broadcast"
    """How weights reach the servers: ``broadcast`` (a process group over
    ``sync_backend``; any machine) or, for a trainer on the server's own GPU (one server,
    ``model.device: cuda``), CUDA IPC handles the server opens in place: one per tensor
    (``cuda_ipc``) or one per chunk (``packed_cuda_ipc``)."""
    sleep_level: Literal[0, 1, 2] = 0
    """Colocated (a CUDA IPC ``sync_strategy``, ``trainer.mode: sync``): the server sleeps
    while the trainer trains (vLLM sleep mode, ``--enable-sleep-mode``): 1 keeps its
    weights in CPU memory, 2 drops them; the KV cache is freed either way and the weight
    sync wakes it. 0: it never sleeps."""

    @field_validator("cpu_cores", mode="before")
    @classmethod
    def _core_numbers(cls, value: Any) -> Any:
        """YAML reads ``[0, 1]`` as numbers: one core each."""
        if isinstance(value, list):
            return [str(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value]
        return value

    @model_validator(mode="after")
    def _servers(self) -> PolicyServersConfig:
        n = self.num_servers
        if n > 1 and self.port is not None:
            raise ValueError(
                f"port={self.port} with num_servers={n}: each server needs its own port; "
                "leave port null (free ports are picked)"
            )
        if n > 1 and not self.start_server:
            raise ValueError(
                f"num_servers={n} with start_server=false: list the running servers in urls"
            )
        if self.urls and self.start_server:
            raise ValueError("urls lists running servers; set start_server: false to use them")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"urls lists a server twice: {self.urls}")
        for url in self.urls:
            if not re.fullmatch(r"https?://[^/\s]+/?", url):
                raise ValueError(f"urls: {url!r} is not a base URL like http://host:port")
        if self.cpu_cores and len(self.cpu_cores) != n:
            raise ValueError(
                f"cpu_cores lists {len(self.cpu_cores)} core sets for num_servers={n}; "
                "give one per server"
            )
        tp = self.tensor_parallel_size
        for cores in self.cpu_cores:
            workers = cores.split("|")
            if not all(re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", w) for w in workers):
                raise ValueError(f"cpu_cores: {cores!r} is not a core list like '0-3' or '0,2'")
            if len(workers) != tp:
                raise ValueError(
                    f"cpu_cores: {cores!r} gives {len(workers)} worker core set(s) for "
                    f"tensor_parallel_size={tp}; give one per worker, joined by '|' (e.g. "
                    f"{'|'.join(str(i) for i in range(tp))!r})"
                )
        if tp > 1 and "--tensor-parallel-size" in " ".join(self.extra_args):
            raise ValueError(
                "extra_args sets --tensor-parallel-size and so does tensor_parallel_size; "
                "keep tensor_parallel_size (ludic sizes the weight-sync group from it)"
            )
        if self.sync_strategy != "broadcast" and self.server_count > 1:
            raise ValueError(
                f"sync_strategy={self.sync_strategy} shares the trainer's GPU with one server; "
                f"{self.server_count} servers need sync_strategy: broadcast"
            )
        if self.sleep_level and self.sync_strategy == "broadcast":
            raise ValueError(
                f"sleep_level={self.sleep_level} puts a server that shares the trainer's GPU to "
                "sleep; set sync_strategy: cuda_ipc (or packed_cuda_ipc), or sleep_level: 0"
            )
        return self

    @property
    def server_count(self) -> int:
        """How many servers the run talks to."""
        return len(self.urls) if self.urls else self.num_servers
