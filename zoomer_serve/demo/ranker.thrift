// The demo ranking service over Thrift, served by zoomer_serve.demo.thrift_server with the same
// handler code (zoomer_serve.demo.service.RankerCore) as the gRPC service of ranker.proto. Field
// names match ranker.proto, so one validation serves both. Thrift has no streaming calls: the
// gRPC PredictStream has no counterpart here.
//
// Loaded at run time with thriftpy2 (no code generation): zoomer_serve.demo.thrift_server.ranker_thrift().

namespace py zoomer.demo.v1

// Ids of one categorical (sparse) feature of one candidate, summed by the model
// (nn.EmbeddingBag, mode="sum"); 1 .. max_ids_per_feature ids, each in [0, table_size).
struct SparseFeature {
  1: list<i64> ids
}

// One item to score.
struct Candidate {
  // Dense (continuous) features, exactly DLRMConfig.num_dense finite values.
  1: list<double> dense
  // Categorical features, exactly len(DLRMConfig.table_sizes) entries, in table order.
  2: list<SparseFeature> sparse
}

// A batch of candidates scored in one forward pass.
struct PredictRequest {
  // Opaque caller id, echoed in the response.
  1: string request_id
  // 1 .. max_batch_size candidates.
  2: list<Candidate> candidates
}

struct PredictResponse {
  // Echo of PredictRequest.request_id.
  1: string request_id
  // Click probability in (0, 1), one per candidate, same order as the request.
  2: list<double> scores
  // Identifies the model that produced the scores.
  3: string model_version
}

// The request cannot be scored (gRPC: INVALID_ARGUMENT); message names the candidate, the
// feature and the offending value.
exception InvalidRequest {
  1: string message
}

// Scores recommendation candidates with the DLRM demo model (click probability).
service Ranker {
  // Scores one batch of candidates.
  PredictResponse Predict(1: PredictRequest request) throws (1: InvalidRequest invalid)
}
