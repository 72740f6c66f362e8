"""The vLLM names the parsers use whose module moved between vLLM 0.26 and 0.32 (0.33 as 0.32)."""

from __future__ import annotations

try:  # vLLM >= 0.28
    from vllm.entrypoints.generate.base.protocol import (
        DeltaFunctionCall,
        DeltaMessage,
        DeltaToolCall,
        ExtractedToolCallInformation,
        FunctionCall,
        ToolCall,
    )
except ImportError:  # vLLM 0.26
    from vllm.entrypoints.openai.engine.protocol import (  # type: ignore[no-redef]
        DeltaFunctionCall,
        DeltaMessage,
        DeltaToolCall,
        ExtractedToolCallInformation,
        FunctionCall,
        ToolCall,
    )

try:  # vLLM >= 0.28
    from vllm.renderers.chat_utils import make_tool_call_id
except ImportError:  # vLLM 0.26
    from vllm.entrypoints.chat_utils import make_tool_call_id  # type: ignore[no-redef]

__all__ = [
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "ExtractedToolCallInformation",
    "FunctionCall",
    "ToolCall",
    "make_tool_call_id",
]
