"""kvarn_kernels"""
