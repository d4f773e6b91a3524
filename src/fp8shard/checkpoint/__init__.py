"""Sharded checkpoints in model space: save, resume bit-exactly, reshard, never lose one.

``torch.distributed.checkpoint`` underneath; see docs/checkpoint.md and [Note: checkpoint
space], [Note: checkpoint keys], [Note: flat pieces], [Note: atomic checkpoints].

    save_checkpoint(path, model, optimizer, extra={...})      # collective, atomic
    info = load_checkpoint(path_or_root, model, optimizer)     # collective, any world size
    latest_checkpoint(root) -> Path | None                     # newest complete one
    load_model_weights(path, model)                            # weights only (eval, fine-tune)
    import_hf_state_dict(model, state_dict_or_file)            # high precision -> FP8 model
    export_safetensors(path_or_None, model, "model.safetensors")
"""

from fp8shard.checkpoint.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
)
from fp8shard.checkpoint.export import (
    export_safetensors,
    import_hf_state_dict,
    load_model_weights,
    read_model_state,
    read_state_dict_file,
)
from fp8shard.checkpoint.io import (
    LoadedCheckpoint,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    resolve_checkpoint,
    save_checkpoint,
)
from fp8shard.checkpoint.manifest import FORMAT, VERSION, read_manifest

__all__ = [
    "FORMAT", "VERSION", "CheckpointError", "CheckpointFormatError", "CheckpointMismatchError",
    "CheckpointNotFoundError", "CheckpointSaveError", "LoadedCheckpoint", "checkpoint_path",
    "export_safetensors", "import_hf_state_dict", "latest_checkpoint", "list_checkpoints", "load_checkpoint",
    "load_model_weights", "prune_checkpoints", "read_manifest", "read_model_state",
    "read_state_dict_file", "resolve_checkpoint", "save_checkpoint",
]
