"""Adapters that let other trainers select this library by configuration: torchtitan's checkpoint-manager
contract (`torchtitan`) and Lightning's `CheckpointIO` (`lightning`). Each imports its trainer only in its own
module; nothing here is imported by the package itself."""
