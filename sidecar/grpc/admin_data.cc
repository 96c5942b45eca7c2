// Admin calls about data kept by leapd: the dataset export (training data
// from the engine's own traffic) and the persisted quality history.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "sidecar/core/bootstrap.h"
#include "sidecar/grpc/admin_service.h"
#include "sidecar/grpc/status.h"

namespace leap::sidecar {

namespace pb = ::leap::v1;

void FillQualityHistory(LiveReadout& r, int64_t limit, int64_t window,
                        pb::ListVersionsResponse* resp) {
  const std::vector<VersionRecord> versions = r.Versions();
  const size_t from = limit > 0 && versions.size() > static_cast<size_t>(limit)
                          ? versions.size() - static_cast<size_t>(limit)
                          : 0;
  for (size_t i = from; i < versions.size(); ++i) {
    FillVersion(versions[i], resp->add_versions());
  }
  resp->set_total_versions(static_cast<int64_t>(versions.size()));
  resp->set_window(window);
  for (const QualityWindow& w : r.QualityWindows(limit)) {
    pb::QualityWindow* out = resp->add_windows();
    out->set_first_completion(w.first_completion);
    out->set_completions(w.completions);
    out->set_first_version(w.first_version);
    out->set_last_version(w.last_version);
    out->set_start_unix_ms(w.start_unix_ms);
    out->set_end_unix_ms(w.end_unix_ms);
    out->set_spearman(w.spearman);
  }
  for (const LabelQuality& l : r.LabelQualities()) {
    pb::LabelQuality* out = resp->add_labels();
    out->set_label(l.label);
    out->set_from_version(l.from_version);
    out->set_to_version(l.to_version);
    out->set_completions(l.completions);
    out->set_spearman(l.spearman);
  }
}

grpc::Status AdminService::ExportDataset(
    grpc::ServerContext* ctx, const pb::ExportDatasetRequest* req,
    grpc::ServerWriter<pb::DatasetChunk>* writer) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  storage::StateStore* store = core_->store();
  if (store == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "leapd keeps no dataset without --data_dir");
  }
  if (req->limit() < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "limit must be >= 0");
  }
  if (absl::Status s = ValidateReadoutName(req->readout()); !s.ok()) return ToGrpc(s);
  absl::StatusOr<storage::DatasetStats> st = store->GetDatasetStats(req->readout());
  if (!st.ok()) return ToGrpc(st.status());
  auto live = core_->GetReadout(req->readout());
  if (st->records == 0 && !live.ok()) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("unknown readout '", req->readout(),
                                     "' (no such readout and no dataset records)"));
  }
  // The width: the readout's, else the newest record's.
  int64_t dim = live.ok() ? (*live)->spec().dim : 0;
  if (dim == 0) {
    store->ScanDataset(req->readout(), 1, [&](const storage::DatasetRecord& r) {
      dim = static_cast<int64_t>(r.features.size() / DTypeSize(r.dtype));
      return false;
    }).IgnoreError();
  }
  std::vector<float> x;
  std::vector<int64_t> tokens;
  int64_t skipped = 0;
  absl::Status loaded = LoadDatasetRows(store, req->readout(), dim, req->limit(),
                                        &x, &tokens, &skipped);
  if (!loaded.ok()) return ToGrpc(loaded);
  pb::DatasetChunk head;
  head.set_dim(dim);
  head.set_records(static_cast<int64_t>(tokens.size()));
  head.set_skipped(skipped);
  if (!writer->Write(head)) return grpc::Status::CANCELLED;
  const int64_t per_chunk =
      std::max<int64_t>(1, (int64_t{4} << 20) / std::max<int64_t>(1, dim * 4));
  for (int64_t i = 0; i < static_cast<int64_t>(tokens.size()); i += per_chunk) {
    if (ctx->IsCancelled()) return grpc::Status::CANCELLED;
    const int64_t rows =
        std::min<int64_t>(per_chunk, static_cast<int64_t>(tokens.size()) - i);
    pb::DatasetChunk c;
    c.set_rows(rows);
    c.set_features(std::string(reinterpret_cast<const char*>(x.data() + i * dim),
                               static_cast<size_t>(rows * dim) * 4));
    for (int64_t k = 0; k < rows; ++k) c.add_tokens(tokens[i + k]);
    if (!writer->Write(c)) return grpc::Status::CANCELLED;
  }
  return grpc::Status::OK;
}

}  // namespace leap::sidecar
