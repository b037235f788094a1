// The overhead benchmark's Thrift echo (benchmarks/_bench_configs.py, server kind "thrift_echo"): one call
// that returns its payload, the Thrift counterpart of the gRPC raw-bytes echo. Loaded with thriftpy2.load.

service Echo {
  binary echo(1: binary payload)
}
