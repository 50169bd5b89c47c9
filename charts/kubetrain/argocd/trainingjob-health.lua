-- Argo CD health check for kubetrain.io/TrainingJob, from the status the operator writes.
-- Pending, Running, Restarting: Progressing; Succeeded: Healthy; Failed: Degraded with
-- the Failed condition's message; Suspended: Suspended; a phase it does not know: Unknown.
-- Until the operator has seen the latest spec (status.observedGeneration), the job is
-- Progressing whatever its phase.
-- docs/gitops.md and charts/kubetrain/README.md embed this file; a test checks they agree.
local hs = {}

local function condition_message(kind)
  if obj.status.conditions ~= nil then
    for _, condition in ipairs(obj.status.conditions) do
      if condition.type == kind and condition.status == "True" and condition.message ~= nil then
        return condition.message
      end
    end
  end
  return nil
end

if obj.status == nil or obj.status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the kubetrain operator to create the workers"
  return hs
end

local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the kubetrain operator to observe generation " .. generation
  return hs
end

local phase = obj.status.phase
if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = condition_message("Succeeded") or "Training is complete"
elseif phase == "Failed" then
  hs.status = "Degraded"
  hs.message = condition_message("Failed") or "The job failed"
elseif phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = condition_message("Suspended") or "runPolicy.suspend is true"
elseif phase == "Restarting" then
  hs.status = "Progressing"
  hs.message = condition_message("Restarting") or "Restarting workers"
elseif phase == "Running" then
  hs.status = "Progressing"
  hs.message = condition_message("Running") or "Workers running"
  local progress = obj.status.progress
  if progress ~= nil and progress.step ~= nil and progress.maxSteps ~= nil then
    hs.message = hs.message .. ", step " .. progress.step .. " of " .. progress.maxSteps
  end
elseif phase == "Pending" then
  hs.status = "Progressing"
  hs.message = "Waiting for the workers to start"
else
  hs.status = "Unknown"
  hs.message = "Phase " .. phase .. " is not known to this health check"
end
return hs
