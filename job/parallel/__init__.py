"""Arrays over devices: meshes, the sharding rules and host synchronisation behind the public
`job.sharding` and `job.multihost`, and pytree names and fingerprints."""
