"""Tools an environment offers the model: the toolbox (schemas, safe calls) and built-in tools.

`Toolbox` runs ParsedCalls (services/common/tool_calls.py) against plain Python callables; the built-in
tools are `calculator` (exact arithmetic) and `python` (a sandboxed process, sandbox.py).
"""

from services.env.tools.calculator import calculator
from services.env.tools.sandbox import SandboxLimits, SandboxResult, python, python_tool, run_python
from services.env.tools.toolbox import Toolbox, ToolResult, error_message, tool_message, tool_schema

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "ToolResult",
    "Toolbox",
    "calculator",
    "error_message",
    "python",
    "python_tool",
    "run_python",
    "tool_message",
    "tool_schema",
]
