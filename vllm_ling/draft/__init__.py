"""The speculative drafts vLLM runs beside Ling V3: the MTP draft (`mtp`, registered as BailingMoeV3MTPModel), the
DSpark drafter (`dspark`), the check that a draft reads the target's own head and embedding (`check`), and the
draft vocabulary (`vocab`, read from the file `vocab_file` describes). Imports nothing: `register()` names these
modules as lazy "module:Class" strings."""
