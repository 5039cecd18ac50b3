"""The shared kernel: config, errors, events, logging, ids, files, Slurm client.

It imports none of ``launcher``, ``ftar``, ``ckpt``, ``health``, ``slurm_plugins``
and never imports torch.
"""
