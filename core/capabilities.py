"""What a deployment declares, and the registry of request options.

Declarations are frozen data. The gate (``ifb.gate``) and the matrix
(``ifb.matrix``) read them once at load time; the engine reads the resolved
per-option support at submit and admission. A declaration is a promise that
the plugin's tests hold.
"""

from __future__ import annotations

import enum
from typing import Any, Callable

import attrs

from ifb.params import RequestSpec
from ifb.speculative import SpeculationCaps


class Support(enum.Enum):
    """How a request option is treated under in-flight batching."""

    SERVED = "served"
    FOUNDER_ONLY = "founder-only"  # the head waits for the batch to drain and founds the next one
    RUNS_ALONE = "runs-alone"  # founder-only, and nobody joins while it runs (guided decoding)
    REJECTED = "rejected"  # submit() raises RequestRejected naming the alternative
    NOT_APPLICABLE = "n/a"  # the deployment has no such feature on any path: refused everywhere


class EndpointSupport(enum.Enum):
    SERVED = "served"
    REFUSED_UNDER_IFB = "refused under in-flight batching"  # per request, naming the flag
    ABSENT = "absent"  # the deployment has no such endpoint


@attrs.frozen
class OptionSupport:
    support: Support
    reason: str = ""
    alternative: str = ""
    #: stall counter bumped at each boundary where a head using this option cannot join
    stall_counter: str = "stalls_incompatible"


@attrs.frozen
class RequestOption:
    """A request option the engine knows about; plugins may register more.

    ``uses(spec)`` says whether a request uses it. ``default`` is the support a
    deployment gets when it does not declare this option.
    ``relative_to_batch`` marks options whose use is judged against the running
    batch (differing sampling parameters): the engine compares batch keys.
    """

    name: str
    title: str
    uses: Callable[[RequestSpec], bool]
    default: OptionSupport
    relative_to_batch: bool = False
    order: int = 100
    #: the request field a refusal of this option names (``param`` of the 400), if any
    param: Callable[[RequestSpec], str | None] | None = None


@attrs.frozen
class DeploymentCaps:
    """A deployment's declaration, resolved for one deploy configuration."""

    stepped_execution: bool
    seated_admission: bool
    max_batch_size: int  # the batch dimension the runtime was built for
    num_ranks: int = 1
    batch_invariant_verified: bool = False
    options: dict[str, OptionSupport] = attrs.field(factory=dict)
    endpoints: dict[str, EndpointSupport] = attrs.field(factory=dict)
    #: why the deployment is not stepped / not seated, shown by the gate
    notes: str = ""
    #: a joiner's max_tokens must equal the running batch's (the founder's)
    batch_wide_generation_length: bool = False
    #: whether KV blocks can be reused across requests (prefix caching)
    supports_prefix_reuse: bool = True
    prefix_reuse_note: str = ""
    #: drafted tokens verified in the step's forward (speculative decoding), as configured; None: none
    speculation: SpeculationCaps | None = None
    #: the runtime shards over ``num_ranks`` > 1 ranks (``ifb.parallel``); else why not
    supports_tensor_parallel: bool = False
    tensor_parallel_note: str = ""

    def option(self, opt: RequestOption) -> OptionSupport:
        return self.options.get(opt.name, opt.default)


@attrs.frozen
class DeployConfig:
    """How the user asked a model to be served (CLI flags / LLM arguments)."""

    model: str | None = None
    #: the deployment kind (or plugin) that loads the model; None: the kind that declares ``is_default``
    plugin: str | None = None
    max_batch_size: int = 4
    enable_in_flight_batching: bool = False
    max_queued_requests: int = 64
    queue_timeout: float = 60.0
    enable_context_reuse: bool = False
    max_kv_cache_capacity: int | None = None  # tokens
    max_num_batched_tokens: int = 256  # per-step token budget (chunked prefill)
    #: ranks the deployment spans (``--tensor-parallel-size``)
    num_ranks: int = 1
    #: seconds any collective between the ranks may take; past it the silent rank is lost
    collective_timeout: float = 60.0
    #: the torch device (``cpu``, ``cuda``, ``cuda:N``); None: ``cuda`` when present, else ``cpu``
    #: (``ifb.placement``; a loaded deployment's config holds the resolved name)
    device: str | None = None
    #: the weights' floating dtype: ``auto`` (bfloat16 on CUDA, float32 on the CPU) or a dtype's name
    dtype: str = "auto"
    options: dict[str, Any] = attrs.field(factory=dict)  # plugin-specific settings


@attrs.frozen
class MatrixVariant:
    """A deployment-level row of the support matrix: a title and a configuration to declare."""

    title: str
    config: DeployConfig
    note: str = ""


@attrs.frozen
class DeploymentKind:
    """A kind of deployment a plugin can build.

    ``declare(config)`` returns the capabilities for that configuration without
    loading weights; ``load(config)`` builds the runtime. ``settings`` names the
    ``DeployConfig.options`` keys the kind reads: any other key is refused at load
    time rather than ignored (None: not declared, every key is passed through).
    """

    name: str
    plugin: str
    title: str
    declare: Callable[[DeployConfig], DeploymentCaps]
    load: Callable[[DeployConfig], Any]
    variants: tuple[MatrixVariant, ...] = ()
    description: str = ""
    settings: frozenset[str] | None = None
    #: the kind ``ifb serve`` and ``LLM`` load when no plugin is named (one installed kind says so)
    is_default: bool = False
    #: the torch device types ``load`` builds on (``ifb.placement``): an unset ``--device`` is ``cuda``
    #: only where the kind builds there and a CUDA device is present; any other type is refused
    device_types: frozenset[str] = frozenset({"cpu", "cuda"})


@attrs.frozen
class DeploySetting:
    """A deployment setting a plugin adds (``ifb_deploy_settings``): one ``DeployConfig.options`` key,
    given as the ``ifb serve`` flag ``--name-with-dashes`` or the ``LLM(name=...)`` keyword.

    ``type`` is a click parameter type (``click.Choice``, ``click.FloatRange``, ``click.Path``, ...) or
    ``int``, ``float``, ``str``; both the flag and the keyword are converted (and checked) by it, then by
    ``to_option`` when given (say, a ``Path`` to the ``str`` the loader reads). A value equal to
    ``default`` (False for an ``is_flag`` setting) means "not set": it is not put into
    ``DeployConfig.options``.
    """

    name: str
    help: str
    type: Any = str
    default: Any = None
    metavar: str | None = None
    is_flag: bool = False
    to_option: Callable[[Any], Any] | None = None
    #: the plugin that registered it (set by the plugin host)
    plugin: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parse(self, value: Any) -> Any:
        """``value`` (an ``LLM`` keyword's) as the flag would give it; ValueError naming the flag if bad."""
        import click

        if self.is_flag:
            if not isinstance(value, bool):
                raise ValueError(f"{self.flag} ({self.name}) is a flag: True or False, not {value!r}")
        elif value is not None:
            try:
                value = click.types.convert_type(self.type).convert(value, None, None)
            except click.BadParameter as exc:
                raise ValueError(f"{self.flag} ({self.name}): {exc.message}") from None
        return self.option_value(value)

    def option_value(self, value: Any) -> Any:
        """The ``DeployConfig.options`` value for a converted ``value`` (None: not set)."""
        if value is None or value == self.default or (self.is_flag and value is False):
            return None
        return self.to_option(value) if self.to_option is not None else value
