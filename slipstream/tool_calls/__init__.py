"""Tool calling (docs/tools.md): tools shown to the model, calls valid by construction, parsed back.

spec.py checks a request's tools; formats.py knows how each model family writes calls and shows
tools; the grammar that makes every call valid is slipstream/grammar/tool_calls.py; parser.py reads
calls back out of the text (streamed or not); plan.py joins them for one request.
"""
from slipstream.tool_calls.plan import ToolPlan, make_plan
from slipstream.tool_calls.spec import MAX_TOOLS, Tool, ToolRequest, tool_request

__all__ = ["MAX_TOOLS", "Tool", "ToolPlan", "ToolRequest", "make_plan", "tool_request"]
