"""Adapters that let other trainers select this library by configuration: torchtitan's checkpoint-manager
contract (`torchtitan`, with `titan_qkv`: its fused QKV weights saved without a gather) and Lightning's
`CheckpointIO` (`lightning`). Each imports its trainer only in its own modules; nothing here is imported by the
package itself."""
