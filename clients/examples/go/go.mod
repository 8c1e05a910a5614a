module nanoplane-example

go 1.23

require (
	google.golang.org/grpc v1.72.0
	google.golang.org/protobuf v1.36.6
)
