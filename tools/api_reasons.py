"""Why a Megatron Core 0.19.2 name is absent here, or differs: read by tools/api_report.py.

Keys are `module:name`, `module:*` or `*:name` (first match wins, in that order)."""

REASONS = {}


def reason_for(module, name):
    for key in (f"{module}:{name}", f"{module}:*", f"*:{name}"):
        if key in REASONS:
            return REASONS[key]
    return "not implemented yet"
