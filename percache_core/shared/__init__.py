"""The shared tier: chunk states and QA entries on Redis (standalone or Cluster), behind
each client's local tier, with a local Bloom-filter catalog so that a miss costs no
network round trip."""
