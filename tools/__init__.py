"""ling_tools: the commands and fixtures that stand beside the served plugin, not in it: the self-check
(`python3 -m ling_tools.selfcheck`), the demo (`python3 -m ling_tools.demo`), the tiny-checkpoint writer
(`python3 -m ling_tools.tiny`, `ling-make-tiny`), the draft-vocabulary builder (`python3 -m ling_tools.draft_vocab`),
the checkpoint's tensor list (`ling_tools.tensors`) and the vLLM release check (`python3 -m ling_tools.seams`)."""
