"""The ``protocol`` section of a run config: one member per protocol name, each with only its own fields.

``ProtocolSpec`` is a union discriminated by ``name``: ``bsp`` and ``fmb`` take the round fields, ``amb``
adds the time budget, ``backup`` is a round with at least one backup worker, ``asp`` may damp by
staleness, ``ssp`` adds the bound, ``kasync`` its K and ``timed`` its window. A field of another member
is a one-line error naming it. Which rules run a name is the core's registry
(``ps_server.core.protocols``); this module only says what a name takes.

A new name over an old config keeps what carries over: ``--set protocol.name=asp`` over a BSP config
drops the fields ASP lacks that were at their BSP defaults (``renamed``), and a policy's switch takes
the fields the new member shares with those in force (``Switching``). A protocol written before the
union, every field flat (a run's ``config.yaml``, a checkpoint), reads as its member (``unflattened``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, TypeAdapter, field_validator, model_validator

from switchps import names
from switchps.problems import Problems, did_you_mean
from switchps.config.optimizer import OptimizerSpec
from switchps.config.schema import MAX_BATCH, MAX_SIM_WORKERS, MAX_STEPS, Section


class Base(Section):
    """What every protocol takes: its name and its sample budget."""

    name: str = "bsp"
    """One of ``switchps.names.PROTOCOLS``: bsp, fmb, amb, asp, ssp, kasync, timed, backup, local_sgd, diloco,
    async_local_sgd, async_diloco."""
    batch: int = Field(32, gt=0, le=MAX_BATCH)
    """Samples per worker step (the sample budget), at most 2**20; FMB is BSP with this fixed batch."""
    micro_batch: int | None = Field(None, gt=0, le=MAX_BATCH)
    """Samples per gradient micro-batch, at most 2**20; defaults to `batch`."""
    local_steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    """H: a worker takes H steps of `batch` samples on its own copy of the model with `inner_optimizer`, then
    pushes what the copy moved (a pseudo-gradient, which the PS applies with `outer_optimizer`); with AMB's
    time budget, as many as fit in T, at most H and at least one. None: a gradient every step."""
    inner_optimizer: OptimizerSpec | None = None
    """The workers' optimizer for local steps (default: the run's `optimizer` under local SGD; AdamW at
    lr 0.001 under DiLoCo); its schedule counts a worker's local steps."""
    inner_state: Literal["keep", "reset"] = "keep"
    """Whether a worker's inner optimizer state (momentum, Adam's moments) persists across rounds or is reset
    at each one."""
    outer_optimizer: OptimizerSpec | None = None
    """The PS's optimizer for pushed movements (default: SGD at lr 1, plain averaging, under local SGD;
    Nesterov momentum 0.9 at lr 0.7 under DiLoCo). The run's `optimizer` steps gradients."""

    @property
    def local(self) -> bool:
        """Workers take local steps and push what they moved (``local_steps``)."""
        return self.local_steps is not None

    def inner(self, configured: OptimizerSpec) -> OptimizerSpec:
        """The inner optimizer in force (``configured``: the run's optimizer)."""
        return self.inner_optimizer or (DILOCO_INNER if self.name in DILOCO else configured)

    def outer(self) -> OptimizerSpec:
        """The outer optimizer in force."""
        return self.outer_optimizer or (DILOCO_OUTER if self.name in DILOCO else AVERAGING)

    @model_validator(mode="before")
    @classmethod
    def _foreign(cls, data: Any) -> Any:
        """A field another protocol takes: one line naming it and who takes it (not "unknown key")."""
        if not isinstance(data, dict) or cls is Unknown:
            return data
        foreign = [k for k in data if k not in cls.model_fields and k in TAKEN_BY]
        if foreign:
            name = data.get("name", "bsp")
            raise Problems([(k, f"{name} takes no {k} (a field of {', '.join(TAKEN_BY[k])})") for k in foreign])
        return data


DILOCO = ("diloco", "async_diloco")
"""The names whose inner and outer optimizers default to DiLoCo's (Douillard et al., 2023)."""
DILOCO_INNER = OptimizerSpec(name="adamw", learning_rate=0.001)
DILOCO_OUTER = OptimizerSpec(name="nesterov", learning_rate=0.7, params={"momentum": 0.9})
AVERAGING = OptimizerSpec(name="sgd", learning_rate=1.0)
"""Local SGD's outer step: the model moves by the workers' mean movement."""


class Rounds(Base):
    """The round fields (bsp, fmb, amb, backup, local_sgd, diloco)."""

    name: Literal["bsp", "fmb"] = "bsp"
    deadline_s: float = Field(30.0, gt=0)
    """A worker that has not pushed this long after a round began is marked inactive."""
    backup_workers: int = Field(0, ge=0, lt=MAX_SIM_WORKERS)
    """Complete a round on the first N-k pushes and drop the k late ones (k < N)."""
    excluded_pushes: Literal["join", "drop"] = "join"
    """Stale pushes from workers a policy took out of the barrier (elastic) join a later round as stale
    contributions, or are dropped and counted."""


class Backup(Rounds):
    name: Literal["backup"] = "backup"  # type: ignore[assignment]
    backup_workers: int = Field(1, ge=1, lt=MAX_SIM_WORKERS)
    """k >= 1: complete a round on the first N-k pushes and drop the k late ones (k < N)."""


class AMB(Rounds):
    name: Literal["amb"] = "amb"  # type: ignore[assignment]
    time_budget_s: float = Field(gt=0)
    """T, the compute time per step, from receiving the work order to pushing (required)."""
    max_batch: int | None = Field(None, gt=0, le=MAX_BATCH)
    """The upper bound on samples per step (default 4 x batch), at most 2**20."""


class ASP(Base):
    name: Literal["asp"] = "asp"
    staleness_lr: bool = False
    """Damp the learning rate by staleness, lr/(1+tau)."""


class SSP(ASP):
    name: Literal["ssp"] = "ssp"  # type: ignore[assignment]
    staleness: int = Field(3, ge=0, le=MAX_STEPS)
    """How many clocks a worker may run ahead of the slowest (at most 2**31 - 1)."""
    deadline_s: float = Field(30.0, gt=0)
    """A laggard holding a worker back that has not pushed this long is marked inactive."""


class KAsync(Base):
    name: Literal["kasync"] = "kasync"
    k: int | None = Field(None, gt=0, le=MAX_SIM_WORKERS)
    """Apply one update of the first K pushes, whatever their versions (default: the workers)."""


class Timed(Base):
    name: Literal["timed"] = "timed"
    window_s: float = Field(gt=0)
    """Apply whatever arrived every window_s seconds, at least one push (required)."""


class LocalSGD(Rounds):
    """Synchronous local SGD: rounds of H local steps, the movements averaged (the outer step)."""

    name: Literal["local_sgd", "diloco"] = "local_sgd"  # type: ignore[assignment]
    local_steps: int | None = Field(8, ge=1, le=MAX_STEPS)


class AsyncLocalSGD(ASP):
    """Asynchronous local SGD: each worker's movement after H local steps is applied on arrival."""

    name: Literal["async_local_sgd", "async_diloco"] = "async_local_sgd"  # type: ignore[assignment]
    local_steps: int | None = Field(8, ge=1, le=MAX_STEPS)


class Unknown(Base):
    """A name that is none of the above: reported on ``name``, with the shared fields still checked."""

    model_config = ConfigDict(extra="ignore")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        raise ValueError(f"unknown protocol {v!r}{did_you_mean(v, names.PROTOCOLS)}; "
                         f"expected one of {', '.join(names.PROTOCOLS)}")


MEMBERS: dict[str, type[Base]] = {"bsp": Rounds, "fmb": Rounds, "amb": AMB, "asp": ASP, "ssp": SSP,
                                  "kasync": KAsync, "timed": Timed, "backup": Backup, "local_sgd": LocalSGD,
                                  "diloco": LocalSGD, "async_local_sgd": AsyncLocalSGD, "async_diloco": AsyncLocalSGD}
"""Each name's member, in ``names.PROTOCOLS`` order."""
TAKEN_BY: dict[str, list[str]] = {}
"""Each field, with the names that take it."""
for _name, _member in MEMBERS.items():
    for _field in _member.model_fields:
        TAKEN_BY.setdefault(_field, []).append(_name)


def member(name: Any) -> type[Base]:
    """The member a protocol ``name`` validates as (``Unknown`` for anything else)."""
    return MEMBERS.get(name, Unknown) if isinstance(name, str) else Unknown


def carried(fields: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The ``fields`` protocol ``name`` takes, under that name: what a switch to it keeps of a spec."""
    return {**{k: v for k, v in fields.items() if k in member(name).model_fields}, "name": name}


def _tag(v: Any) -> str:
    """The member ``v`` is for: its name (bsp when it gives none), or ``unknown``."""
    name = v.get("name", "bsp") if isinstance(v, dict) else getattr(v, "name", None)
    return name if isinstance(name, str) and name in MEMBERS else "unknown"


ProtocolSpec = Annotated[
    Union[Annotated[Rounds, Tag("bsp")], Annotated[Rounds, Tag("fmb")], Annotated[AMB, Tag("amb")],
          Annotated[ASP, Tag("asp")], Annotated[SSP, Tag("ssp")], Annotated[KAsync, Tag("kasync")],
          Annotated[Timed, Tag("timed")], Annotated[Backup, Tag("backup")], Annotated[LocalSGD, Tag("local_sgd")],
          Annotated[LocalSGD, Tag("diloco")], Annotated[AsyncLocalSGD, Tag("async_local_sgd")],
          Annotated[AsyncLocalSGD, Tag("async_diloco")], Annotated[Unknown, Tag("unknown")]],
    Discriminator(_tag)]
"""The protocol in force and its parameters; policies change them live."""

_SPEC: TypeAdapter[ProtocolSpec] = TypeAdapter(ProtocolSpec)


def protocol_spec(fields: Mapping[str, Any]) -> ProtocolSpec:
    """Validate ``fields`` as the member their name picks (``pydantic.ValidationError`` if they are not)."""
    return _SPEC.validate_python(dict(fields))


FLAT = frozenset({"name", "batch", "micro_batch", "time_budget_s", "max_batch", "deadline_s", "backup_workers",
                  "excluded_pushes", "staleness", "staleness_lr", "k", "window_s"})
"""The keys of a protocol as written before the union (a run's ``config.yaml``, a checkpoint's spec):
every protocol's fields, flat."""


def unflattened(d: dict[str, Any]) -> dict[str, Any]:
    """``d``, or, written flat (``FLAT``), its member's fields: the others had no effect under its name."""
    if set(d) != FLAT:
        return d
    return {k: v for k, v in d.items() if k in member(d["name"]).model_fields}


def saved_spec(d: dict[str, Any]) -> ProtocolSpec:
    """A spec as a checkpoint holds it, flat (``unflattened``) or as its member."""
    return protocol_spec(unflattened(d))


def renamed(raw: dict[str, Any], old: str) -> dict[str, Any]:
    """A raw ``protocol`` section whose name was changed from ``old`` (``--set protocol.name=asp``): the
    fields the new member lacks are dropped where they hold ``old``'s default (the user changed the name,
    not them); one set to anything else stays, to be reported."""
    before, after = member(old), member(raw.get("name", "bsp"))
    if Unknown in (before, after) or before is after:
        return raw
    return {k: v for k, v in raw.items() if k in after.model_fields or k not in before.model_fields
            or before.model_fields[k].is_required() or v != before.model_fields[k].default}
