"""kvarn_ckpt"""
