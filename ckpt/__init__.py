"""Checkpoints: in-memory dual-buffer snapshots, peer backup, state serving, HDF5 tier.

Modules (torch only in ``torch_state``; everything else needs numpy, h5py for
``persist``, and the standard library):

* ``manifest``: tensor specs, layout, CRC-32 checksums, JSON manifest (pure)
* ``placement``: backup-rank placement and catch-up source choice (pure)
* ``wire``: routes, authentication and byte ranges of the HTTP protocol (pure)
* ``dual`` / ``snapshot``: the two alternating buffers, the background copy, and
  the checksums computed when a snapshot is first used
* ``serve`` / ``fetch``: the state server and its client (catch-up, backup push)
* ``backup``: backups held for peers and the sender of our own
* ``held``: those backups as files in a node-local tmpfs, outliving the process
* ``persist``: the HDF5 tier
* ``restore``: memory -> backup peer -> local disk -> persistent store
* ``rank``: one rank's checkpointing wired together for the training loop
* ``torch_state``: torch model / optimizer / scheduler / RNG as a state source

Tunables come from ``ft_launch.config.CkptConfig`` (``[ckpt]``): ``RankCheckpointer``
reads them all; the lower-level classes take them as arguments whose defaults
are that section's defaults.
"""
