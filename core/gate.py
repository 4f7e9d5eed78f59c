"""The one load-time gate: can this deployment run under in-flight batching?"""

from __future__ import annotations

from ifb.capabilities import DeployConfig, DeploymentCaps

#: how many ranks the stepped engine drives in this release
ENGINE_MAX_RANKS = 1


class UnsupportedDeployment(RuntimeError):
    """Start-up refusal: the deployment cannot run under in-flight batching."""


def ifb_unsupported_reason(caps: DeploymentCaps, config: DeployConfig) -> str | None:
    """Why ``caps`` cannot be served under in-flight batching with ``config``; None when it can.

    Decided once, at load time. With the flag a reason is a start-up error;
    without it the deployment runs on the blocking path.
    """
    if not caps.stepped_execution:
        why = f" ({caps.notes})" if caps.notes else ""
        return f"the runtime does not support stepped execution{why}"
    if config.max_batch_size > 1 and not caps.seated_admission:
        why = f" ({caps.notes})" if caps.notes else ""
        return (f"max_batch_size {config.max_batch_size} > 1 needs seated admission, "
                f"which this runtime does not support{why}")
    if config.max_batch_size > caps.max_batch_size:
        return (f"max_batch_size {config.max_batch_size} exceeds the batch size the runtime "
                f"was built for ({caps.max_batch_size})")
    if caps.num_ranks > ENGINE_MAX_RANKS:
        return (f"the runtime spans {caps.num_ranks} ranks; the in-flight engine drives "
                f"{ENGINE_MAX_RANKS} in this release")
    if config.enable_context_reuse and not caps.supports_prefix_reuse:
        why = f": {caps.prefix_reuse_note}" if caps.prefix_reuse_note else ""
        return f"--enable-context-reuse is not supported by this deployment{why}"
    return None


def check_deployment(caps: DeploymentCaps, config: DeployConfig) -> str | None:
    """Apply the gate for ``config``: raise when the flag is set and the gate refuses.

    Returns the reason the deployment runs on the blocking path (None when it is
    served under in-flight batching or the flag was not asked for).
    """
    reason = ifb_unsupported_reason(caps, config)
    if config.enable_in_flight_batching and reason is not None:
        raise UnsupportedDeployment(f"cannot enable in-flight batching: {reason}")
    if not config.enable_in_flight_batching and config.enable_context_reuse and not caps.supports_prefix_reuse:
        raise UnsupportedDeployment(
            f"--enable-context-reuse is not supported by this deployment: {caps.prefix_reuse_note}")
    return reason
