"""Library warnings a vime user cannot act on, kept off the console.

Megatron-core warns on every import that Apex and Transformer Engine are absent and that it
falls back to torch implementations (the CPU build and vime's GPU path use those fallbacks on
purpose), and on every layer about arguments it fills in itself. Each trainer actor forwards
them to the driver's console through Ray, a page per run. Only these messages are silenced, and
only when they come from Megatron's modules.
"""

from __future__ import annotations

import warnings

MEGATRON_NOISE = (
    r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed",
    r"full scope is deprecated",
    r"MLP requires ffn_hidden_size",
    r"(Warning: )?tp_group is None",
    r"The following imports from `dynamic_context.py` will be removed",
    r"The 'megatron.core.transformer.custom_layers.transformer_engine'",
)


def quiet_library_warnings() -> None:
    """Install the filters (idempotent: warnings.filterwarnings drops an identical filter)."""
    for message in MEGATRON_NOISE:
        warnings.filterwarnings("ignore", message=message, module=r"megatron(\..*)?$")
