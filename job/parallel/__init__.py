"""Arrays over devices: meshes, the sharding rules and host synchronisation behind the public
`job.sharding` and `job.multihost`, which rows of a batch each process holds, and pytree names and
fingerprints."""
