"""The plan: mesh dims -> roles and places, which keys go where, how sequences split, the wire format.

Pure: nothing here talks to ``torch.distributed``; everything is testable without processes.
"""
