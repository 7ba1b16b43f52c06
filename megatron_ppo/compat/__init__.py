"""Differences between the versions of the libraries we run on, each behind one small module.

  mcore.py  megatron-core 0.16.1 through 0.19.x: its version, the dist checkpoint's common-state layout, and the
            refusal of a checkpoint written by a newer megatron-core than the one reading it
"""
