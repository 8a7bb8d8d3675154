#include "tools/train/train_dist.h"

#include "models/nn.h"
#include "ops/ops.h"
#include "tools/cli/cli.h"
#ifdef KILN_WITH_NCCL
#include "tools/train/rendezvous.h"
#include "cuda/nccl.h"
#endif

namespace kiln::train {

#ifdef KILN_WITH_NCCL

bool data_parallel_available() { return true; }

std::unique_ptr<cuda::Communicator> join_communicator(Rendezvous& rv, int device) {
  const Rendezvous::Blob id =
      rv.broadcast(rv.rank() == 0 ? cuda::Communicator::make_unique_id() : Rendezvous::Blob{});
  return std::make_unique<cuda::Communicator>(id, rv.rank(), rv.world_size(), device);
}

struct DataParallel::Impl {
  Device device;
  std::unique_ptr<Rendezvous> rv;
  std::unique_ptr<cuda::Communicator> comm;
};

namespace {

class BucketedStep final : public StepRunner {
 public:
  BucketedStep(cuda::Communicator& comm, nn::Module& model, optim::FusedOptimizer& opt,
               optim::DynamicLossScaler& scaler, double label_smoothing, double max_grad_norm)
      : comm_(comm),
        model_(model),
        opt_(opt),
        scaler_(scaler),
        label_smoothing_(label_smoothing),
        max_grad_norm_(max_grad_norm),
        buckets_(comm, model.parameters()) {
    const TensorOptions f32 = TensorOptions(DType::f32).with_device(opt.device());
    // Σ loss·N in f64, as optim::ClassifierStep's (optim/train_step.cpp says why).
    loss_sum_ = zeros({}, TensorOptions(DType::f64).with_device(opt.device()));
    correct_sum_ = zeros({}, f32);
  }

  void run(const Tensor& x, const Tensor& y) override {
    opt_.zero_grad();
    Tensor logits = model_(x);
    Tensor loss = F::cross_entropy(logits, y, label_smoothing_);
    scaler_.scale(loss).backward();  // buckets launch as their gradients complete
    buckets_.finish();               // .grad = average over ranks
    if (scaler_.enabled() || max_grad_norm_ > 0) scaler_.unscale_(opt_);
    if (scaler_.enabled()) comm_.agree_found_inf(scaler_.found_inf());
    // Every rank holds the same averaged gradients, so the same norm and coefficient.
    if (max_grad_norm_ > 0) optim::clip_grad_norm_(opt_, max_grad_norm_);
    scaler_.step(opt_);
    scaler_.update();
    NoGradGuard no_grad;
    F::add_(loss_sum_, loss.detach().to(DType::f64), double(y.size(0)));
    F::add_(correct_sum_, F::sum(F::eq(F::argmax(logits.detach(), 1), y).to(DType::f32)));
  }
  const Tensor& loss_sum() const override { return loss_sum_; }
  const Tensor& correct_sum() const override { return correct_sum_; }
  void reset_metrics() override {
    loss_sum_.zero_();
    correct_sum_.zero_();
  }

 private:
  cuda::Communicator& comm_;
  nn::Module& model_;
  optim::FusedOptimizer& opt_;
  optim::DynamicLossScaler& scaler_;
  double label_smoothing_, max_grad_norm_;
  cuda::GradBucketer buckets_;
  Tensor loss_sum_, correct_sum_;
};

}  // namespace

DataParallel::DataParallel(const DistEnv& env, nn::Module& model)
    : impl_(std::make_unique<Impl>()) {
  impl_->device = Device::cuda(env.local_rank);
  impl_->rv = std::make_unique<Rendezvous>(env);
  impl_->comm = join_communicator(*impl_->rv, env.local_rank);
  NoGradGuard no_grad;
  impl_->comm->broadcast(model.state());
}

DataParallel::~DataParallel() = default;

std::unique_ptr<StepRunner> DataParallel::make_step(nn::Module& model, optim::FusedOptimizer& opt,
                                                    optim::DynamicLossScaler& scaler,
                                                    double label_smoothing,
                                                    double max_grad_norm) {
  return std::make_unique<BucketedStep>(*impl_->comm, model, opt, scaler, label_smoothing,
                                        max_grad_norm);
}

int64_t DataParallel::enable_sync_batch_norm(nn::Module& model) {
  // The current stream, not GradBucketer's: NCCL runs the operations of one communicator in
  // the order they are issued, whatever their streams, and every rank issues these and the
  // gradient buckets in the same order (its backward's), so they cannot cross. The price: a
  // backward SyncBN reduction waits for the bucket all-reduces issued before it.
  cuda::Communicator* comm = impl_->comm.get();
  return nn::enable_sync_batch_norm(
      model, [comm](const Tensor& t) { comm->all_reduce(t, ReduceOp::Sum); });
}

void DataParallel::sync_buffers(nn::Module& model) {
  NoGradGuard no_grad;
  impl_->comm->broadcast(model.buffers());
}

void DataParallel::sum_host(std::vector<double>& values) {
  Tensor host = empty({int64_t(values.size())}, DType::f64);
  for (size_t i = 0; i < values.size(); ++i) host.data<double>()[i] = values[i];
  Tensor dev = host.to(impl_->device);
  impl_->comm->all_reduce(dev, ReduceOp::Sum);
  Tensor back = dev.to(Device::cpu());
  for (size_t i = 0; i < values.size(); ++i) values[i] = back.data<double>()[i];
}

#else  // no NCCL

bool data_parallel_available() { return false; }

struct DataParallel::Impl {};

DataParallel::DataParallel(const DistEnv& env, nn::Module&) {
  // The launcher's variables asked for it (RANK/WORLD_SIZE, mpirun's or srun's).
  cli::usage_error("this process is ", env.describe(),
                   ": data-parallel training needs a kiln built with CUDA and NCCL");
}

DataParallel::~DataParallel() = default;

std::unique_ptr<StepRunner> DataParallel::make_step(nn::Module&, optim::FusedOptimizer&,
                                                    optim::DynamicLossScaler&, double, double) {
  return nullptr;
}
int64_t DataParallel::enable_sync_batch_norm(nn::Module&) { return 0; }
void DataParallel::sync_buffers(nn::Module&) {}
void DataParallel::sum_host(std::vector<double>&) {}

#endif

}  // namespace kiln::train
