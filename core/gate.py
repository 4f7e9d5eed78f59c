"""The one load-time gate: can this deployment run under in-flight batching?"""

from __future__ import annotations

from ifb.capabilities import DeployConfig, DeploymentCaps

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
    if caps.num_ranks > 1 and not caps.supports_tensor_parallel:
        return tensor_parallel_refusal(caps)
    if config.enable_context_reuse and not caps.supports_prefix_reuse:
        why = f": {caps.prefix_reuse_note}" if caps.prefix_reuse_note else ""
        return f"--enable-context-reuse is not supported by this deployment{why}"
    return None


def tensor_parallel_refusal(caps: DeploymentCaps) -> str:
    why = f": {caps.tensor_parallel_note}" if caps.tensor_parallel_note else ""
    return f"the runtime cannot be sharded over {caps.num_ranks} ranks (tensor parallelism){why}"


def check_deployment(caps: DeploymentCaps, config: DeployConfig) -> str | None:
    """Apply the gate for ``config``: raise when the flag is set and the gate refuses.

    Returns the reason the deployment runs on the blocking path (None when it is
    served under in-flight batching or the flag was not asked for).
    """
    if caps.num_ranks > 1 and not caps.supports_tensor_parallel:
        # no path serves it: one rank instead of the N asked for would be a silent fallback
        raise UnsupportedDeployment(f"--tensor-parallel-size {caps.num_ranks}: {tensor_parallel_refusal(caps)}")
    reason = ifb_unsupported_reason(caps, config)
    if config.enable_in_flight_batching and reason is not None:
        raise UnsupportedDeployment(f"cannot enable in-flight batching: {reason}")
    if not config.enable_in_flight_batching and config.enable_context_reuse and not caps.supports_prefix_reuse:
        raise UnsupportedDeployment(
            f"--enable-context-reuse is not supported by this deployment: {caps.prefix_reuse_note}")
    return reason
