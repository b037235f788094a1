// A small ranking service over Thrift: score candidate items for a request with a torch model.
// Loaded at run time with thriftpy2 (no code generation): thriftpy2.load("ranker.thrift").

namespace py examples.ranker.v1

// One item to score; features: exactly server.NUM_FEATURES finite values.
struct Candidate {
  1: string item_id
  2: list<double> features
}

struct RankRequest {
  // Opaque caller id, echoed in the response.
  1: string request_id
  // 1 .. 256 candidates, scored in one forward pass.
  2: list<Candidate> candidates
}

struct ScoredItem {
  1: string item_id
  2: double score
}

struct RankResponse {
  1: string request_id
  // The candidates, best first.
  2: list<ScoredItem> items
}

// The request cannot be scored; message says why.
exception InvalidRequest {
  1: string message
}

service Ranker {
  // Scores the candidates and returns them best first.
  RankResponse Rank(1: RankRequest request) throws (1: InvalidRequest invalid)
}
