"""kvarn_vllm"""
