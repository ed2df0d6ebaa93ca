"""Serializers: MLX cache objects <-> Record, and Record <-> safetensors bytes or files."""
